/*
 * outbox.pml: the transactional outbox relay (issue 19; being built, so this models its
 * design): K relays publish the rows that producers committed to the outbox table.
 *
 * The design modelled
 *   producer  outbox.add(tx, ...) inside the business transaction: a row becomes visible when
 *             that transaction commits. Rows of one ordering key commit in id order (one
 *             aggregate's transactions are serialised by its row lock), so id order is
 *             commit order.
 *   relay     BEGIN;
 *             SELECT ... WHERE NOT sent AND no earlier unsent row of the same key
 *               FOR UPDATE SKIP LOCKED        (the oldest pending row of each key, unless another
 *                                              relay's open transaction holds its lock)
 *             for each claimed row: publish with a publisher confirm; confirmed ->
 *               UPDATE ... SET sent (or DELETE), in the transaction
 *             COMMIT                           (marks applied, locks released)
 *   The "earlier unsent row" test reads committed rows whether locked or not: a plain read is
 *   not blocked by a row lock, and SKIP LOCKED applies only to the rows the query locks. Its
 *   snapshot may be older than the locks it takes, which only makes it see an earlier row
 *   still unsent (marks never go back), so the model takes the claim as one atomic step.
 *   The batch is any non-empty subset of the claimable rows (LIMIT batch_size takes a prefix
 *   in id order; a subset covers every prefix). A relay with nothing to claim waits
 *   (LISTEN/NOTIFY or its poll interval) until a row is claimable. SQLite has no SKIP LOCKED;
 *   its one relay holding a relay lease is the K = 1 case of this model (the lease itself:
 *   lease.pml).
 *
 * Faults: a relay dies between publishing a row and committing (its transaction rolls back:
 * locks released, marks lost; it restarts). Dying at any other step loses only locks and
 * nothing published, which is a slow relay that starts over: states reached anyway. The
 * broker is down (the publish fails: no mark, the row is retried later); a confirm is lost
 * (the broker has the message, the relay thinks it failed: no mark).
 *
 * Properties (assertions):
 *   order:    a row is published only after every earlier row of its key was published
 *   twice:    each publication of a row after its first is paid for by one crash between
 *             publishing it and committing its mark, or by one lost confirm
 * Liveness (-DLIVENESS, pan -a -f): every committed row is eventually published at least once
 * and marked sent.
 *
 * Bounds and why they suffice: K = 2 relays (an order violation needs two relays each holding
 * a row of one key; a third only repeats one of the two roles); three rows, r0 and r2 of key A
 * and r1 of key B between them (two rows of a key for the order; a row of another key, which
 * must not wait for key A); one crash, one outage, one lost confirm (each violation needs one).
 * -DK=3 is checked too.
 *
 * Mutants that must fail (the test checks SPIN finds each):
 *   -DMUTANT_MARK_BEFORE_PUBLISH  mark sent and commit, then publish: a crash or an outage
 *                                 after the commit loses the row (caught by the liveness run)
 *   -DMUTANT_SKIP_LOCKED_FIRST    the oldest pending row of a key is picked among the unlocked
 *                                 ones, so a later row is claimed while an earlier is in flight
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

bool committed[R];      /* the producer's transaction committed the row */
bool sent[R];           /* the committed mark */
byte lock[R];           /* the relay whose open transaction holds the row lock */
byte published[R];      /* ghost: times the broker received the row */
byte excuses[R];        /* ghost: crashes after publishing it, before the commit; lost confirms */
byte crashes, outages, lost_confirms;

/* An earlier row e of r's key is committed and not sent yet (R = 3: e is 0 or 1). */
#ifdef MUTANT_SKIP_LOCKED_FIRST
#define EARLIER_PENDING(e, r) \
  (e < r && KEY(e) == KEY(r) && committed[e] && !sent[e] && lock[e] == NOBODY)
#else
#define EARLIER_PENDING(e, r) (e < r && KEY(e) == KEY(r) && committed[e] && !sent[e])
#endif
#define CLAIMABLE(r) (committed[r] && !sent[r] && lock[r] == NOBODY \
                      && !EARLIER_PENDING(0, r) && !EARLIER_PENDING(1, r))

/* An earlier row of r's key has never reached the broker. */
#define EARLIER_SAME_KEY_UNPUBLISHED(r) \
  ((0 < r && KEY(0) == KEY(r) && published[0] == 0) || \
   (1 < r && KEY(1) == KEY(r) && published[1] == 0))

hidden byte in_order, first_or_excused;   /* asserted at once: not part of the state */

inline publish_row() {   /* the broker receives row r */
  printf("relay %d publishes r%d\n", k, r);
  in_order = !EARLIER_SAME_KEY_UNPUBLISHED(r);
  assert(in_order);              /* order */
  first_or_excused = published[r] <= excuses[r];
  assert(first_or_excused);      /* twice */
  published[r]++
}

proctype relay(byte k) {
  byte r, mine, tried, confirmed;

end_waiting:
  atomic {   /* BEGIN; SELECT ... FOR UPDATE SKIP LOCKED LIMIT batch_size */
    CLAIMABLE(0) || CLAIMABLE(1) || CLAIMABLE(2) ->
    mine = 0;
    for (r : 0 .. R - 1) {   /* any non-empty subset of the claimable rows: any LIMIT */
      if :: CLAIMABLE(r) -> if :: mine = mine | BIT(r) :: skip fi :: else -> skip fi
    }
    for (r : 0 .. R - 1) {
      if :: mine == 0 && CLAIMABLE(r) -> mine = BIT(r) :: else -> skip fi
    }
    for (r : 0 .. R - 1) {
      if :: mine & BIT(r) -> lock[r] = k; printf("relay %d claims r%d\n", k, r) :: else -> skip fi
    }
    tried = 0; confirmed = 0
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
    if
    :: r == R -> goto committing
    :: else -> skip
    fi;
    tried = tried | BIT(r);
    if
    :: outages < MAX_OUTAGE -> outages++; printf("broker down: r%d not published\n", r)
    :: lost_confirms < MAX_LOST_CONFIRM ->
         publish_row(); lost_confirms++; excuses[r]++; printf("confirm of r%d lost\n", r)
    :: true -> publish_row(); confirmed = confirmed | BIT(r)   /* UPDATE ... SET sent, in the tx */
    fi
  }
  if
  :: crashes < MAX_CRASH ->   /* dies before COMMIT: rolled back, locks released */
       atomic {
         crashes++; printf("relay %d dies\n", k);
         for (r : 0 .. R - 1) {
           if :: mine & BIT(r) -> lock[r] = NOBODY :: else -> skip fi;
           if :: confirmed & BIT(r) -> excuses[r]++ :: else -> skip fi
         }
         r = 0; mine = 0; tried = 0; confirmed = 0
       };
       goto end_waiting
  :: true -> goto publishing
  fi;
committing:
  atomic {   /* COMMIT */
#ifndef MUTANT_MARK_BEFORE_PUBLISH
    for (r : 0 .. R - 1) {
      if
      :: confirmed & BIT(r) -> sent[r] = true; printf("relay %d commits: r%d sent\n", k, r)
      :: else -> skip
      fi;
      if :: mine & BIT(r) -> lock[r] = NOBODY :: else -> skip fi
    }
#endif
    r = 0; mine = 0; tried = 0; confirmed = 0
  }
  goto end_waiting
}

active proctype producer() {
  byte r;
  for (r : 0 .. R - 1) { committed[r] = true; printf("producer commits r%d\n", r) }
  r = 0
}

init {
  byte i;
  atomic {
    for (i : 0 .. R - 1) { lock[i] = NOBODY }
    for (i : 0 .. K - 1) { run relay(i) }
    i = 0
  }
}

#ifdef LIVENESS
ltl all_published_and_sent {
  <> (published[0] > 0 && published[1] > 0 && published[2] > 0 && sent[0] && sent[1] && sent[2])
}
#endif
