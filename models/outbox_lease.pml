/*
 * outbox_lease.pml: the outbox relay on SQLite, which has no row locks: K relays lease rows
 * (lease_owner, lease_until_ms) in one short write transaction, publish them, then delete the
 * confirmed ones in another.
 *
 * Mirrors
 *   src/idemq/outbox/relay.py  OutboxRelay.run_once, OutboxRelay._leased_batch
 *   src/idemq/outbox/relay.py  OutboxRelay._publish, OutboxRelay._settle
 *   src/idemq/outbox/statements.py  statements_for, Statements.claim, Statements.delete_sent
 *   src/idemq/outbox/statements.py  Statements.fail, Statements.renew_leases, Statements.delete_leased
 *   src/idemq/outbox/outbox.py  Outbox.add: MAX(seq) + 1 under SQLite's one write lock
 *
 * The claim takes the rows that are due, unleased or with an expired lease, and the head of
 * their ordering key: no earlier row of the key unsent, leased or not. SQLite runs one writer at
 * a time, so each statement is one atomic step here, and a producer's INSERT and COMMIT are one
 * step (seq order is commit order).
 *
 * The design (issue 30): the relay renews its row leases while it publishes (renew_leases), the
 * lease is checked in the step that publishes a row (a row it no longer holds is not sent), and
 * the delete takes only rows it still holds (delete_leased). -DNO_ROW_FENCE is the code before
 * it: no renewal, no check before the publish, the delete by owner only.
 *
 * Time. A row lease runs out when its relay does not renew it: with -DNO_ROW_FENCE whenever the
 * relay is slow (a publish that stalls; no fault needed), in the design only by a pause of the
 * whole relay longer than the lease (MAX_PAUSE). A pause that hits a row its relay has already
 * sent but not yet deleted is a crash between the confirm and the commit that came back to life:
 * counted as an excuse, as the crash is.
 *
 * Faults: a relay dies after publishing, before its delete commits (the leases stay until they
 * run out); the broker is down (the batch stops); a confirm is lost (the broker has the message,
 * the relay counts a refusal: the row's lease is released, it is tried again).
 *
 * Properties (assertions):
 *   order:  a row is published only after every earlier row of its key was published
 *   twice:  each publication of a row after its first is paid for by a crash between publishing
 *           it and deleting it, a lost confirm, or a pause in that same window
 * Liveness (-DLIVENESS, pan -a -f): every row is eventually published and deleted.
 *
 * Bounds and why they suffice: K = 2 relays (the stalled one and the one that takes its row over;
 * -DK=3 is checked too); three rows, r0 and r2 of key A and r1 of key B; one crash, one outage,
 * one lost confirm, one pause.
 *
 * Configurations that must fail (the test checks SPIN finds each):
 *   -DNO_ROW_FENCE       a relay stalled in publish past its row lease: another relay leases
 *                        the row, publishes and deletes it, then the first publishes it again
 *   -DMUTANT_NO_FENCE    leases renewed, but no check before the publish: a paused relay sends
 *                        a row another relay has already sent
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
#ifndef MAX_PAUSE
#define MAX_PAUSE 1
#endif

bool committed[R];      /* the producer's transaction committed the row */
bool sent[R];           /* deleted: confirmed and settled */
byte owner[R];          /* lease_owner */
bool expired[R];        /* lease_until_ms is past */
bool renewing[K];       /* relay k renews its leases now */
byte exposed[K];        /* ghost: bit r: k sent r and has not settled it yet */
byte published[R];      /* ghost: times the broker received the row */
byte excuses[R];        /* ghost */
byte crashes, outages, lost_confirms, pauses;

/* An earlier row of r's key is committed and unsent (leased or not): r is not its key's head. */
#define EARLIER_PENDING(e, r) (e < r && KEY(e) == KEY(r) && committed[e] && !sent[e])
#define CLAIMABLE(r) (committed[r] && !sent[r] && (owner[r] == NOBODY || expired[r]) \
                      && !EARLIER_PENDING(0, r) && !EARLIER_PENDING(1, r))
#define EARLIER_SAME_KEY_UNPUBLISHED(r) \
  ((0 < r && KEY(0) == KEY(r) && published[0] == 0) || \
   (1 < r && KEY(1) == KEY(r) && published[1] == 0))
#define HELD(r) (owner[r] == k && !expired[r])

hidden byte in_order, first_or_excused;

inline publish_row() {
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
  atomic {   /* claim: UPDATE ... SET lease_owner, lease_until_ms ... RETURNING */
    CLAIMABLE(0) || CLAIMABLE(1) || CLAIMABLE(2) ->
    mine = 0;
    for (r : 0 .. R - 1) {   /* any non-empty subset: any LIMIT */
      if :: CLAIMABLE(r) -> if :: mine = mine | BIT(r) :: skip fi :: else -> skip fi
    }
    for (r : 0 .. R - 1) {
      if :: mine == 0 && CLAIMABLE(r) -> mine = BIT(r) :: else -> skip fi
    }
    for (r : 0 .. R - 1) {
      if
      :: mine & BIT(r) -> owner[r] = k; expired[r] = false; printf("relay %d leases r%d\n", k, r)
      :: else -> skip
      fi
    }
#ifndef NO_ROW_FENCE
    renewing[k] = true;
#endif
    tried = 0; confirmed = 0
  }
publishing:   /* in seq order */
  atomic {
    r = 0;
    do
    :: r < R && !((mine & BIT(r)) && !(tried & BIT(r))) -> r++
    :: else -> break
    od;
    if :: r == R -> goto settling :: else -> skip fi;
    tried = tried | BIT(r);
#if !defined(NO_ROW_FENCE) && !defined(MUTANT_NO_FENCE)
    if
    :: !HELD(r) -> printf("relay %d no longer holds r%d: not sent\n", k, r); goto publishing
    :: else -> skip
    fi;
#endif
    if
    :: outages < MAX_OUTAGE ->   /* BrokerUnavailableError: this row and the rest wait */
         outages++; printf("broker down: r%d not published\n", r); goto settling
    :: lost_confirms < MAX_LOST_CONFIRM ->
         publish_row(); lost_confirms++; excuses[r]++; printf("confirm of r%d lost\n", r)
    :: true -> publish_row(); confirmed = confirmed | BIT(r); exposed[k] = exposed[k] | BIT(r)
    fi
  }
  if
  :: crashes < MAX_CRASH ->   /* dies before the delete: its leases stay until they run out */
       atomic {
         crashes++; printf("relay %d dies\n", k);
         for (r : 0 .. R - 1) {
           if :: confirmed & BIT(r) -> excuses[r]++ :: else -> skip fi
         }
         renewing[k] = false; exposed[k] = 0; r = 0; mine = 0; tried = 0; confirmed = 0
       };
       goto end_waiting
  :: true -> goto publishing
  fi;
settling:
  atomic {   /* the second write transaction */
    for (r : 0 .. R - 1) {
      if
#ifdef NO_ROW_FENCE
      :: confirmed & BIT(r) && owner[r] == k ->   /* delete_sent: AND lease_owner = :owner */
#else
      :: confirmed & BIT(r) && HELD(r) ->         /* delete_leased */
#endif
           sent[r] = true; owner[r] = NOBODY; printf("relay %d deletes r%d\n", k, r)
      :: (mine & BIT(r)) && !(confirmed & BIT(r)) && owner[r] == k ->
           owner[r] = NOBODY   /* fail (a refusal) or left for later: the lease is released */
      :: else -> skip
      fi
    }
    renewing[k] = false; exposed[k] = 0; r = 0; mine = 0; tried = 0; confirmed = 0
  }
  goto end_waiting
}

/* Producers in any order: each INSERT ... COMMIT is one write, and its seq is MAX(seq) + 1 under
 * the write lock, so of key A's two rows the one that commits first is r0 by definition. */
active proctype producer() {
end_adding:
  do
  :: atomic { !committed[0] -> committed[0] = true; printf("producer commits r0\n") }
  :: atomic { !committed[1] -> committed[1] = true; printf("producer commits r1\n") }
  :: atomic { committed[0] && !committed[2] -> committed[2] = true; printf("producer commits r2\n") }
  od
}

/* The clock: a lease runs out unless its relay renews it; a pause runs out a renewed one. */
#define RUNS_OUT(r) (committed[r] && owner[r] != NOBODY && !expired[r] && \
                     (!renewing[owner[r]] || pauses < MAX_PAUSE))

inline run_out(r) {
  if
  :: renewing[owner[r]] ->
       pauses++;
       if :: exposed[owner[r]] & BIT(r) -> excuses[r]++ :: else -> skip fi
  :: else -> skip
  fi;
  expired[r] = true; printf("r%d's lease (relay %d's) runs out\n", r, owner[r])
}

active proctype clock() {
end_ticking:
  do
  :: atomic { RUNS_OUT(0) -> run_out(0) }
  :: atomic { RUNS_OUT(1) -> run_out(1) }
  :: atomic { RUNS_OUT(2) -> run_out(2) }
  od
}

init {
  byte i;
  atomic {
    for (i : 0 .. R - 1) { owner[i] = NOBODY }
    for (i : 0 .. K - 1) { run relay(i) }
    i = 0
  }
}

#ifdef LIVENESS
ltl all_published_and_sent {
  <> (published[0] > 0 && published[1] > 0 && published[2] > 0 && sent[0] && sent[1] && sent[2])
}
#endif
