/*
 * lease_batch.pml: process_batch in lease mode. Two workers get the same batch of two messages
 * (a redelivery, or two consumers of one queue); each claims every message up front in one
 * round trip, then runs the handlers one after the other.
 *
 * Mirrors
 *   src/idemq/guard/idempotency.py  Idempotency.process_batch, Idempotency._execute (holding.keep,
 *                                   LeaseKeeper.keep and LeaseKeeper.stop around each handler)
 *   src/idemq/guard/batch_flow.py  batch_flow, _handle_leased
 *   src/idemq/guard/flow.py  ClaimMany, Renew, run_handler, Complete, RunHandler
 *   src/idemq/guard/renewal.py  LeaseKeeper.keep, LeaseKeeper.stop, LeaseKeeper._renew_once, LeaseTerms
 *   src/idemq/guard/core.py  judge
 *   src/idemq/stores/sql/store.py  SqlStore.claim_many, SqlStore.renew, SqlStore.complete
 *   src/idemq/stores/sql/plans.py  SqlPlans.claim_many, SqlPlans.renew, SqlPlans.complete
 *   src/idemq/stores/redis/store.py  RedisStore.claim_many, RedisStore.renew, RedisStore.complete
 *   src/idemq/stores/redis/scripts.py  CLAIM_MANY, RENEW, COMPLETE
 *
 * The design (issue 30): every claim the batch holds is renewed while the batch runs (renewal
 * checks the owner: a claim taken over is not extended), and a Renew step re-checks a message's
 * claim right before its handler starts: lost -> that message is IN_PROGRESS, its handler not
 * run. -DRENEW_RUNNING_ONLY is the code before it: a claim is renewed only while its own handler
 * runs, and nothing re-checks it before the handler starts.
 *
 * Time. A lease runs out unless its owner keeps renewing it; `keeper[m]` holds the workers that
 * renew m. The clock may expire any PROCESSING lease its owner does not renew. A renewal that
 * fails for a whole lease (the worker paused, the store unreachable) also runs a lease out: a
 * fault from the MAX_OVERRUN budget. When it hits a message whose handler is running, the
 * handler already started under a live lease: its effect may run twice, as the guarantee
 * excepts (lease_lost is set, complete is refused, a fencing guard absorbs it), so that overrun
 * is counted as the message's excuse.
 *
 * Properties (assertions):
 *   once:      a message's effect runs at most once, plus its excuses
 *   complete:  only the current owner completes, and a message is completed once
 * Liveness (-DLIVENESS, pan -a -f): both messages are eventually PROCESSED and acked by both
 * workers (the unacked ones are redelivered).
 *
 * Bounds and why they suffice: two workers (the batch and its rival); two messages (the first
 * runs while the second's claim waits, which is the window); one overrun. No crash or handler
 * error: lease.pml checks what they do to one record; the defect here needs no fault at all.
 *
 * Configurations that must fail (the test checks SPIN finds each):
 *   -DRENEW_RUNNING_ONLY   the waiting claim of m1 runs out while m0's handler runs, the rival
 *                          takes m1 over and completes it, then the batch runs m1 too
 *   -DMUTANT_NO_RECHECK    every claim renewed, but no Renew step before the handler: a
 *                          renewal that stalled past a waiting claim's lease is not noticed
 */

#define W 2
#define M 2
#define NOBODY 255
#define BIT(i) (1 << (i))
#ifndef MAX_OVERRUN
#define MAX_OVERRUN 1
#endif

mtype = { ABSENT, PROCESSING, PROCESSED };

mtype status[M] = ABSENT;
byte owner[M];
bool expired[M];
byte keeper[M];         /* bit w: worker w renews m */
byte running[M];        /* ghost: bit w: worker w runs m's handler now */
byte eff[M];            /* ghost: effects applied */
byte excuse[M];         /* ghost: overruns that hit m while its handler ran */
byte completions[M];    /* ghost */
byte acked[W];          /* ghost: bit m: worker w acked m (PROCESSED or DUPLICATE) */
byte overruns;

proctype worker(byte w) {
  byte m, won;
  bool held;

delivery:   /* what this worker has not acked comes back */
  if
  :: acked[w] == BIT(M) - 1 -> goto finished
  :: else -> skip
  fi;
  atomic {   /* ClaimMany: every message of the batch in one round trip, then judge */
    won = 0;
    for (m : 0 .. M - 1) {
      if
      :: acked[w] & BIT(m) -> skip
      :: status[m] == ABSENT || (status[m] == PROCESSING && expired[m]) ->
           status[m] = PROCESSING; owner[m] = w; expired[m] = false; won = won | BIT(m);
           printf("w%d claims m%d\n", w, m)
      :: status[m] == PROCESSED -> acked[w] = acked[w] | BIT(m)   /* DUPLICATE */
      :: else -> skip   /* IN_PROGRESS: not acked, redelivered */
      fi
    }
#ifndef RENEW_RUNNING_ONLY
    for (m : 0 .. M - 1) {   /* every held claim is renewed while the batch runs */
      if :: won & BIT(m) -> keeper[m] = keeper[m] | BIT(w) :: else -> skip fi
    }
#endif
    m = 0
  }
  for (m : 0 .. M - 1) {
    if
    :: won & BIT(m) ->
         atomic {
#if !defined(RENEW_RUNNING_ONLY) && !defined(MUTANT_NO_RECHECK)
           /* Renew: the claim re-checked right before the handler starts */
           held = (status[m] == PROCESSING && owner[m] == w && !expired[m]);
#else
           held = true;   /* nothing checks: the handler starts */
#endif
           if
           :: held -> keeper[m] = keeper[m] | BIT(w); running[m] = running[m] | BIT(w);
                      printf("w%d starts m%d's handler\n", w, m)
           :: else -> keeper[m] = keeper[m] & ~BIT(w);
                      printf("w%d: m%d's claim is lost: IN_PROGRESS, not run\n", w, m)
           fi
         }
         if
         :: held ->
              atomic {
                eff[m]++; printf("w%d: m%d's effect\n", w, m);
                assert(eff[m] <= 1 + excuse[m])   /* once */
              }
              atomic {   /* Complete: refused (LeaseLostError) unless still the owner */
                if
                :: status[m] == PROCESSING && owner[m] == w ->
                     status[m] = PROCESSED; completions[m]++; acked[w] = acked[w] | BIT(m);
                     assert(completions[m] == 1);   /* complete */
                     printf("w%d completes m%d\n", w, m)
                :: else -> printf("w%d: complete of m%d refused\n", w, m)
                fi;
                keeper[m] = keeper[m] & ~BIT(w); running[m] = running[m] & ~BIT(w)
              }
         :: else -> skip
         fi
    :: else -> skip
    fi
  }
  goto delivery;
finished:
  skip
}

/* The clock: a lease runs out when its owner does not renew it, or by an overrun fault. */
#define RUNS_OUT(m) (status[m] == PROCESSING && !expired[m] && \
                     ((keeper[m] & BIT(owner[m])) == 0 || overruns < MAX_OVERRUN))

inline run_out(m) {
  if
  :: (keeper[m] & BIT(owner[m])) != 0 ->
       overruns++;
       if :: running[m] & BIT(owner[m]) -> excuse[m]++ :: else -> skip fi
  :: else -> skip
  fi;
  expired[m] = true; printf("m%d's lease (w%d's) runs out\n", m, owner[m])
}

active proctype clock() {
end_ticking:
  do
  :: atomic { RUNS_OUT(0) -> run_out(0) }
  :: atomic { RUNS_OUT(1) -> run_out(1) }
  od
}

init {
  byte i;
  atomic {
    for (i : 0 .. M - 1) { owner[i] = NOBODY }
    for (i : 0 .. W - 1) { run worker(i) }
    i = 0
  }
}

#ifdef LIVENESS
ltl all_processed_and_acked {
  <> (status[0] == PROCESSED && status[1] == PROCESSED && acked[0] == 3 && acked[1] == 3)
}
#endif
