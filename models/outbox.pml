/*
 * outbox.pml: the transactional outbox relay on PostgreSQL (and MySQL/MariaDB): K relays publish
 * the rows that producers committed to the outbox table, claiming them with row locks.
 *
 * Mirrors
 *   src/idemq/outbox/outbox.py  Outbox.add, add_plan: the row is written in the producer's
 *                               transaction, visible when it commits
 *   src/idemq/outbox/statements.py  statements_for: insert_keyed takes pg_advisory_xact_lock on
 *                               the ordering key (LOCK_SPACE) before the row draws its seq
 *   src/idemq/outbox/statements.py  Statements.claim, Statements.delete_sent, Statements.fail
 *   src/idemq/outbox/relay.py  OutboxRelay.run_once, OutboxRelay._locked_batch
 *   src/idemq/outbox/relay.py  OutboxRelay._publish, OutboxRelay._settle, OutboxRelay.run
 *
 * A relay's batch, one transaction:
 *   BEGIN;
 *   rounds: SELECT ... WHERE due AND no earlier unsent row of the same key
 *             ORDER BY seq LIMIT n FOR UPDATE SKIP LOCKED
 *           publish each claimed row with a publisher confirm; DELETE the confirmed ones in the
 *           transaction (its own deletes make a key's next row the head for this relay only;
 *           every other relay still sees the deleted rows and keeps off the key)
 *   COMMIT
 * The "earlier unsent row" test reads committed rows whether locked or not: a plain read is not
 * blocked by a row lock, and SKIP LOCKED applies only to the rows the query locks. Its snapshot
 * may be older than the locks it takes, which only makes it see an earlier row still unsent, so
 * the model takes each claim as one atomic step. A batch is any non-empty subset of the
 * claimable rows (LIMIT takes a prefix in seq order; a subset covers every prefix).
 *
 * Producers run in any order, each INSERT and COMMIT a step of its own. The INSERT draws seq; on
 * PostgreSQL it first takes the key's advisory lock, held to COMMIT, so producers of one key
 * draw seq in the order they commit and a relay never sees a later row of a key committed while
 * an earlier one is not yet. On MySQL/MariaDB this holds when the writers of a key serialise on a
 * row of their own first (the page says so): the same lock. SQLite: outbox_lease.pml.
 *
 * Faults: a relay dies between publishing a row and COMMIT (rolled back: locks released, its
 * deletes lost; it restarts). Dying at any other step loses only locks and nothing published: a
 * slow relay that starts over, states reached anyway. The broker is down (the batch stops); a
 * confirm is lost (the broker has the message, the relay counts a refusal: the row waits).
 *
 * Properties (assertions):
 *   order:  a row is published only after every row of its key with a smaller seq was published
 *   twice:  each publication of a row after its first is paid for by one crash between
 *           publishing it and committing its delete, or by one lost confirm
 * Liveness (-DLIVENESS, pan -a -f): every row is eventually published at least once and deleted.
 *
 * Bounds and why they suffice: K = 2 relays (an order violation needs two relays each holding a
 * row of one key; a third only repeats one of the two roles); three rows, r0 and r2 of key A and
 * r1 of key B (two rows of a key for the order, whichever draws the smaller seq; a row of another
 * key, which must not wait for key A); one crash, one outage, one lost confirm.
 *
 * Mutants that must fail (the test checks SPIN finds each):
 *   -DMUTANT_NO_KEY_LOCK          Outbox.add without the advisory lock: a key's later row commits
 *                                 first, is published, and the earlier one follows it
 *   -DMUTANT_MARK_BEFORE_PUBLISH  mark sent and commit, then publish: a crash or an outage after
 *                                 the commit loses the row (caught by the liveness run)
 *   -DMUTANT_SKIP_LOCKED_FIRST    a key's oldest pending row picked among the unlocked ones, so
 *                                 a later row is claimed while an earlier one is in flight
 */

#ifndef K
#define K 2
#endif
#define R 3
#define KEY(r) (r == 1 -> 1 : 0)
#define BIT(r) (1 << (r))
#define NOBODY 255
#ifndef MAX_CRASH
#define MAX_CRASH 1
#endif
#ifndef MAX_OUTAGE
#define MAX_OUTAGE 1
#endif
#ifndef MAX_LOST_CONFIRM
#define MAX_LOST_CONFIRM 1
#endif

byte seq[R];            /* 0 until the producer's INSERT draws it */
byte next_seq;
byte key_lock[2];       /* the producer whose transaction holds the key's advisory lock */
bool committed[R];      /* the producer's transaction committed the row */
bool sent[R];           /* the committed DELETE (or mark) */
byte lock[R];           /* the relay whose open transaction holds the row lock */
byte gone[K];           /* bit r: relay k deleted r in its open transaction (its own view) */
byte published[R];      /* ghost: times the broker received the row */
byte excuses[R];        /* ghost: crashes after publishing it, before the commit; lost confirms */
byte crashes, outages, lost_confirms;

/* e is an earlier committed row of r's key, and relay k still sees it unsent. */
#define EARLIER(e, r) (e != r && KEY(e) == KEY(r) && committed[e] && seq[e] < seq[r])
#ifdef MUTANT_SKIP_LOCKED_FIRST
#define EARLIER_PENDING(e, r) \
  (EARLIER(e, r) && !sent[e] && !(gone[k] & BIT(e)) && lock[e] == NOBODY)
#else
#define EARLIER_PENDING(e, r) (EARLIER(e, r) && !sent[e] && !(gone[k] & BIT(e)))
#endif
#define CLAIMABLE(r) (committed[r] && !sent[r] && !(gone[k] & BIT(r)) && lock[r] == NOBODY \
                      && !EARLIER_PENDING(0, r) && !EARLIER_PENDING(1, r) \
                      && !EARLIER_PENDING(2, r))
#define ANY_CLAIMABLE (CLAIMABLE(0) || CLAIMABLE(1) || CLAIMABLE(2))

/* A row of r's key with a smaller seq has never reached the broker. */
#define UNPUBLISHED_BEFORE(e, r) \
  (e != r && KEY(e) == KEY(r) && seq[e] != 0 && seq[e] < seq[r] && published[e] == 0)

hidden byte in_order, first_or_excused;   /* asserted at once: not part of the state */

inline publish_row() {   /* the broker receives row r */
  printf("relay %d publishes r%d (seq %d)\n", k, r, seq[r]);
  in_order = !(UNPUBLISHED_BEFORE(0, r) || UNPUBLISHED_BEFORE(1, r) || UNPUBLISHED_BEFORE(2, r));
  assert(in_order);              /* order */
  first_or_excused = published[r] <= excuses[r];
  assert(first_or_excused);      /* twice */
  published[r]++
}

/* SELECT ... WHERE due AND head of its key ... FOR UPDATE SKIP LOCKED LIMIT n: any non-empty
 * subset of the claimable rows (LIMIT takes a prefix in seq order; a subset covers each). */
inline claim_rows() {
  fresh = 0;
  for (r : 0 .. R - 1) {
    if :: CLAIMABLE(r) -> if :: fresh = fresh | BIT(r) :: skip fi :: else -> skip fi
  }
  for (r : 0 .. R - 1) {
    if :: fresh == 0 && CLAIMABLE(r) -> fresh = BIT(r) :: else -> skip fi
  }
  for (r : 0 .. R - 1) {
    if
    :: fresh & BIT(r) -> lock[r] = k; printf("relay %d claims r%d\n", k, r)
    :: else -> skip
    fi
  }
  mine = mine | fresh
}

proctype relay(byte k) {
  byte r, mine, fresh, tried;
  bool stopped;

end_waiting:
  atomic {   /* BEGIN; the first round's claim */
    ANY_CLAIMABLE -> mine = 0; claim_rows(); tried = 0; stopped = false
  }
#ifdef MUTANT_MARK_BEFORE_PUBLISH
  atomic {   /* UPDATE ... SET sent for every claimed row; COMMIT */
    for (r : 0 .. R - 1) {
      if :: mine & BIT(r) -> sent[r] = true; lock[r] = NOBODY :: else -> skip fi
    }
    printf("relay %d marks and commits before publishing\n", k)
  }
#endif
publishing:
  atomic {
    r = 0;
    do
    :: r < R && !((mine & BIT(r)) && !(tried & BIT(r))) -> r++
    :: else -> break
    od;
    if :: r == R -> goto round_end :: else -> skip fi;
    tried = tried | BIT(r);
    if
    :: outages < MAX_OUTAGE ->   /* BrokerUnavailableError: the batch stops */
         outages++; printf("broker down: r%d not published\n", r); stopped = true;
         goto round_end
    :: lost_confirms < MAX_LOST_CONFIRM ->   /* counted as a refusal: retried later */
         publish_row(); lost_confirms++; excuses[r]++; printf("confirm of r%d lost\n", r)
    :: true -> publish_row(); gone[k] = gone[k] | BIT(r)   /* DELETE, in the transaction */
    fi
  }
  if
  :: crashes < MAX_CRASH ->   /* dies before COMMIT: rolled back, locks released */
       atomic {
         crashes++; printf("relay %d dies\n", k);
         for (r : 0 .. R - 1) {
           if :: mine & BIT(r) -> lock[r] = NOBODY :: else -> skip fi;
           if :: gone[k] & BIT(r) -> excuses[r]++ :: else -> skip fi
         }
         r = 0; mine = 0; tried = 0; gone[k] = 0
       };
       goto end_waiting
  :: true -> goto publishing
  fi;
round_end:   /* _locked_batch: another round in the same transaction, or COMMIT */
  if
  :: atomic { !stopped && ANY_CLAIMABLE -> claim_rows(); printf("relay %d: next round\n", k) };
     goto publishing
  :: true
  fi;
  atomic {   /* COMMIT */
#ifndef MUTANT_MARK_BEFORE_PUBLISH
    for (r : 0 .. R - 1) {
      if
      :: gone[k] & BIT(r) -> sent[r] = true; printf("relay %d commits: r%d sent\n", k, r)
      :: else -> skip
      fi;
      if :: mine & BIT(r) -> lock[r] = NOBODY :: else -> skip fi
    }
#endif
    r = 0; mine = 0; tried = 0; gone[k] = 0
  }
  goto end_waiting
}

/* Producers in any order. Outbox.add's INSERT draws the row's seq; on PostgreSQL it first takes
 * the key's advisory lock, held to COMMIT, so two producers of one key draw seq in the order
 * they commit. */
#ifdef MUTANT_NO_KEY_LOCK
#define KEY_FREE(r) true
#define TAKE_KEY(r) skip
#else
#define KEY_FREE(r) (key_lock[KEY(r)] == NOBODY)
#define TAKE_KEY(r) key_lock[KEY(r)] = r
#endif

inline produce(r) {
  if
  :: atomic { seq[r] == 0 && KEY_FREE(r) ->
       TAKE_KEY(r); next_seq++; seq[r] = next_seq; printf("producer of r%d: INSERT, seq %d\n", r, seq[r]) }
  :: atomic { seq[r] != 0 && !committed[r] ->
       committed[r] = true; if :: key_lock[KEY(r)] == r -> key_lock[KEY(r)] = NOBODY :: else -> skip fi;
       printf("producer of r%d: COMMIT\n", r) }
  fi
}

active proctype producers() {
end_adding:
  do
  :: produce(0)
  :: produce(1)
  :: produce(2)
  od
}

init {
  byte i;
  atomic {
    for (i : 0 .. R - 1) { lock[i] = NOBODY }
    key_lock[0] = NOBODY; key_lock[1] = NOBODY;
    for (i : 0 .. K - 1) { run relay(i) }
    i = 0
  }
}

#ifdef LIVENESS
ltl all_published_and_sent {
  <> (published[0] > 0 && published[1] > 0 && published[2] > 0 && sent[0] && sent[1] && sent[2])
}
#endif
