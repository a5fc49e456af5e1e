/*
 * lease.pml: N workers, one message, the lease protocol of lease mode (Redis or SQL).
 *
 * Mirrors
 *   src/idemq/guard/flow.py  message_flow, Claim, Complete, Release, release_noting_failure
 *   src/idemq/guard/flow.py  RunHandler: the handler runs with its claim kept (LeaseTerms)
 *   src/idemq/guard/core.py  judge: lost claim -> DUPLICATE / IN_PROGRESS / mismatch
 *   src/idemq/guard/renewal.py  LeaseKeeper.keep, LeaseKeeper.stop, LeaseKeeper._renew_once,
 *                               _answered, _overdue
 *   src/idemq/guard/idempotency.py  Idempotency._execute: the claim kept (LeaseKeeper.keep) while
 *                                   its handler runs, stopped (LeaseKeeper.stop) in its finally
 *   src/idemq/stores/redis/ops.py  claim, claim_set, _judge_stored: SET NX GET first, on the
 *                                   guard's clock; the script alone on Redis's clock
 *   src/idemq/stores/redis/store.py  RedisStore.claim, RedisStore.renew, RedisStore.release
 *   src/idemq/stores/redis/scripts.py  CLAIM, RENEW, COMPLETE, RELEASE: the takeover with the
 *                                   payload check; renew, complete and release only for the
 *                                   owner's PROCESSING record
 *   src/idemq/stores/sql/store.py  SqlStore._own_transaction: each lease primitive a short
 *                                   transaction of its own, run again after a deadlock
 *   src/idemq/stores/sql/plans.py  SqlPlans.claim_unexpired, SqlPlans.renew, SqlPlans.complete
 *   src/idemq/stores/sql/plans.py  SqlPlans.release (AND status = 0 AND owner = :owner)
 *   src/idemq/stores/sql/dialects.py  PostgresPlans.claim, MariaDbPlans.claim, SqlitePlans.claim
 *   src/idemq/stores/sql/dialects.py  PostgresPlans._takeover_allowed: one-statement claims
 *
 * The claim is one atomic step on the server (`one_step`: SQL's claim statement, the CLAIM
 * script on Redis's clock or a Cluster), or, on Redis with the guard's clock, SET NX GET first
 * and the script only for an expired PROCESSING record; init picks one, as a deployment does.
 *
 * Time. Nothing stores absolute times: `left` is lease_until minus the store's now, so the state
 * space stays finite. By default the store sets and judges expiry on its own clock: the code's
 * lease_clock="store" (the default of SqlStore on PostgreSQL/MariaDB/MySQL and of RedisStore).
 * With -DWORKER_CLOCK it is lease_clock="client" (and SQLite, MemoryStore): each worker writes
 * lease_until = its now + L and judges `lease_until <= its now`, its clock off the store's by a
 * skew in [-S, S] chosen per worker. A request's now_ms is read before its claim round trip;
 * that delay only makes the worker's clock look later-behind, so it is one more skew.
 *
 * The promise. `prom[w]` is what worker w was promised: L ticks since its grant or its last
 * renewal. A tick that runs out a promise a worker still relies on is a fault (the worker was
 * paused, or its renewal stalled a whole lease) and comes from the MAX_OVERRUN budget, as
 * crashes and handler errors come from theirs; the worker it hit is `paused` until its next
 * grant: it may run its handler late, which is the case the guarantee excepts (fencing).
 *
 * Properties (assertions, every run):
 *   exclusive: at every grant (fresh or takeover), every renewal and every handler start of
 *              worker w, no other worker holds a live promise (ALONE(w)); at its handler start
 *              w holds one itself, unless an overrun paused it
 *   fence:     each grant gets an `attempts` greater than every earlier one
 *   payload:   a takeover never hands the id to another payload
 *   complete:  at most one completion, and only by the current owner with the current fence
 * Liveness (-DLIVENESS, pan -a -f): with the budgets spent, the message is eventually PROCESSED.
 *
 * Bounds and why they suffice: N = 3 workers (an old owner, a new owner, and a third whose claim
 * interleaves between them; the last holds another payload under the same id); L = 2, S = 1
 * (L > S, and 2S > 0 is the widest gap two skewed clocks open); one crash, one handler error,
 * one overrun, one renewal per handler run: each violation below needs at most one of each,
 * and every fault adds one grant, so the fence stays bounded.
 *
 * Configurations that must fail (the test checks SPIN finds each):
 *   -DWORKER_CLOCK      lease_clock="client": a worker with a fast clock takes over a live lease
 *   -DRELEASE_DELETES   RELEASE deleting the record: a later fresh claim starts attempts at 1
 *                       again; the fence repeats (the code keeps the counter)
 *   -DMUTANT_COMPLETE_WITHOUT_OWNER   complete without AND owner = :owner (issue 24)
 *   -DMUTANT_TAKEOVER_ANY_PAYLOAD     takeover without the payload comparison
 *   -DMUTANT_RENEW_WITHOUT_OWNER      renew without the owner check: a worker whose lease was
 *                                     taken over extends the new owner's and believes it holds
 *   -DMUTANT_RELEASE_WITHOUT_OWNER    release without the owner check: a late release deletes
 *                                     the new owner's record and a third worker claims it fresh
 *   -DMUTANT_TAKEOVER_COMPLETED       the takeover condition without status = PROCESSING: an
 *                                     expired COMPLETED record is taken over and run again
 */

#define N 3               /* the ALONE judgement below names each worker */
#define L 2
#define S 1
#ifndef MAX_CRASH
#define MAX_CRASH 1
#endif
#ifndef MAX_FAIL
#define MAX_FAIL 1
#endif
#ifndef MAX_OVERRUN
#define MAX_OVERRUN 1
#endif
#ifndef MAX_RENEW
#define MAX_RENEW 1
#endif
#define NOBODY 255      /* owner token of an attempt that ended: no live worker holds it */

mtype = { ABSENT, PROCESSING, PROCESSED };   /* the record */
mtype = { WON, SCRIPT, IN_PROGRESS, SETTLED };   /* what a claim step decided */

mtype status = ABSENT;
byte owner = NOBODY;
short left;             /* store ticks until the lease expires (clamped at -S) */
byte attempts;          /* 1 + takeovers: the fence */
byte payload;
bool one_step;          /* the claim is one statement or script; else SET NX GET goes first */

byte prom[N];           /* ghost: ticks worker w was promised by its grant or renewal; 0: none */
byte max_fence;         /* ghost: the greatest fence granted so far */
byte completions;       /* ghost */
byte paused;            /* ghost: bit w: an overrun ran out w's promise since its grant */
byte crashes, fails, overruns;

/* The promise: no worker but w believes it holds a live lease. */
#define ALONE(w) ((w == 0 || prom[0] == 0) && (w == 1 || prom[1] == 0) && (w == 2 || prom[2] == 0))
/* A tick that would run out a promise the worker still relies on. */
#define BREAKS_PROMISE (prom[0] == 1 || prom[1] == 1 || prom[2] == 1)

#ifdef WORKER_CLOCK
#define EXPIRED (left <= skew)      /* lease_until <= the worker's now */
#define NEW_LEFT (L + skew)         /* lease_until = the worker's now + L */
#else
#define EXPIRED (left <= 0)         /* judged on the store's clock */
#define NEW_LEFT L
#endif

#ifdef MUTANT_TAKEOVER_ANY_PAYLOAD
#define SAME_PAYLOAD true
#else
#define SAME_PAYLOAD (payload == mine)
#endif

#ifdef MUTANT_TAKEOVER_COMPLETED
#define TAKEABLE ((status == PROCESSING || status == PROCESSED) && EXPIRED)
#else
#define TAKEABLE (status == PROCESSING && EXPIRED)
#endif

#ifdef MUTANT_COMPLETE_WITHOUT_OWNER
#define MINE (status == PROCESSING)
#else
#define MINE (status == PROCESSING && owner == w)
#endif

#ifdef MUTANT_RENEW_WITHOUT_OWNER
#define RENEWABLE (status == PROCESSING)
#else
#define RENEWABLE (status == PROCESSING && owner == w)
#endif

#ifdef MUTANT_RELEASE_WITHOUT_OWNER
#define RELEASABLE (status == PROCESSING)
#else
#define RELEASABLE (status == PROCESSING && owner == w)
#endif

inline promised() {   /* a grant or a renewal: w now relies on L ticks */
  prom[w] = L; paused = paused & ~(1 << w);
  assert(ALONE(w))    /* exclusive */
}

inline grant_fresh() {
  attempts++;   /* the record was absent: 1, unless the counter survived a release */
  fence = attempts;
  status = PROCESSING; owner = w; payload = mine; left = NEW_LEFT;
  printf("w%d claims fresh: fence %d, store lease left %d\n", w, fence, left);
  assert(fence > max_fence); max_fence = fence;
  promised()
}

inline takeover() {
  printf("w%d takes over from %d\n", w, owner);
  assert(payload == mine);                    /* payload */
  attempts++;
  fence = attempts; assert(fence > max_fence); max_fence = fence;
  status = PROCESSING; owner = w; left = NEW_LEFT;
  printf("w%d holds fence %d, store lease left %d\n", w, fence, left);
  promised()
}

/* A crash between two steps: the process dies; its delivery comes back to this worker. */
inline maybe_crash() {
  if
  :: crashes < MAX_CRASH ->
       atomic {
         crashes++; printf("w%d crashes\n", w); prom[w] = 0;
         if :: status == PROCESSING && owner == w -> owner = NOBODY :: else -> skip fi
       };
       goto delivery
  :: true -> skip
  fi
}

proctype worker(byte w) {
  byte mine = (w == N - 1 -> 1 : 0);   /* the last worker got another payload under this id */
  short skew = 0;
  byte fence, renewals;
  mtype got;
#ifdef WORKER_CLOCK
  select(skew : -S .. S);
#endif
  printf("w%d: clock skew %d, payload %d\n", w, skew, mine);

delivery:
  /* 1. Redis: claim_set: SET key <record> NX PX gc GET. The pre-check that routes to the
   *    script is the guard's (claim_set_result: PROCESSING and expired), so it uses the same
   *    judge. SQL's one-statement claim is step 2 alone. */
  atomic {
    if
    :: one_step -> got = SCRIPT
    :: !one_step && status == ABSENT -> grant_fresh(); got = WON
    :: !one_step && status == PROCESSING && EXPIRED -> got = SCRIPT
    :: else -> got = (status == PROCESSED || payload != mine -> SETTLED : IN_PROGRESS)
    fi
  }
  if
  :: got == SCRIPT ->
       /* 2. the CLAIM script (or SQL's claim statement), atomic on the server; the record
        *    may have changed since 1. */
       atomic {
         if
         :: status == ABSENT -> grant_fresh(); got = WON
         :: TAKEABLE && SAME_PAYLOAD -> takeover(); got = WON
         :: else -> got = (status == PROCESSED || payload != mine -> SETTLED : IN_PROGRESS)
         fi
       }
  :: else -> skip
  fi;
  if
  :: got == SETTLED -> goto finished   /* DUPLICATE (acked) or PayloadMismatchError (dead letter) */
  :: got == IN_PROGRESS -> goto delivery   /* not acked: the broker redelivers */
  :: got == WON -> skip
  fi;

  maybe_crash();
  atomic {   /* the handler starts */
    printf("w%d's handler starts, promised %d ticks\n", w, prom[w]);
    assert((paused & (1 << w)) || (prom[w] > 0 && ALONE(w)))   /* exclusive */
  }
  /* the handler runs; the renewal watchdog may extend the lease meanwhile */
  renewals = 0;
  do
  :: renewals < MAX_RENEW ->
       renewals++;
       atomic {
         if
         :: RENEWABLE -> left = NEW_LEFT; printf("w%d renews\n", w); promised()
         :: else -> prom[w] = 0; break   /* lost: the handler is told; complete is refused */
         fi
       }
  :: break
  od;
  if
  :: fails < MAX_FAIL ->   /* the handler raised: release (RELEASE), re-raise, redelivered */
       atomic {
         fails++; printf("w%d handler raises: release\n", w); prom[w] = 0;
         if
         :: RELEASABLE ->
              printf("w%d releases %d's record\n", w, owner);
              status = ABSENT; owner = NOBODY; left = 0;
#ifdef RELEASE_DELETES
              attempts = 0;
#endif
         :: else -> skip
         fi
       };
       goto delivery
  :: true -> skip
  fi;

  maybe_crash();   /* between the effect and complete: the crash the guarantee excepts */
  atomic {         /* COMPLETE / sql_complete */
    if
    :: MINE ->
         assert(owner == w && fence == attempts);   /* complete: by the current owner */
         completions++; printf("w%d completes with fence %d\n", w, fence);
         assert(completions == 1);
         status = PROCESSED; left = 0; got = WON
    :: else -> got = IN_PROGRESS; printf("w%d complete refused\n", w)   /* LeaseLostError */
    fi;
    prom[w] = 0
  }
  if
  :: got == WON -> maybe_crash()   /* after complete, before the ack: redelivered, DUPLICATE */
  :: else -> goto delivery
  fi;
finished:
  skip
}

/* The store's clock. A tick may not run out a promise a worker relies on unless a fault is
 * spent: the worker was paused, or its handler outran its renewal. */
active proctype clock() {
end_ticking:
  do
  :: atomic {
       status == PROCESSING && (!BREAKS_PROMISE || overruns < MAX_OVERRUN) ->
       if
       :: BREAKS_PROMISE ->
            overruns++;
            if :: prom[0] == 1 -> paused = paused | 1 :: else -> skip fi;
            if :: prom[1] == 1 -> paused = paused | 2 :: else -> skip fi;
            if :: prom[2] == 1 -> paused = paused | 4 :: else -> skip fi
       :: else -> skip
       fi;
       if :: left > -S -> left-- :: else -> skip fi;
       if :: prom[0] > 0 -> prom[0]-- :: else -> skip fi;
       if :: prom[1] > 0 -> prom[1]-- :: else -> skip fi;
       if :: prom[2] > 0 -> prom[2]-- :: else -> skip fi;
       printf("tick: store lease left %d, promised %d %d %d\n", left, prom[0], prom[1], prom[2])
     }
  od
}

init {
  byte i;
  atomic {
    if :: one_step = true :: one_step = false fi;
    for (i : 0 .. N - 1) { run worker(i) }
  }
}

#ifdef LIVENESS
ltl eventually_processed { <> (status == PROCESSED) }
#endif
