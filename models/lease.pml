/*
 * lease.pml: N workers, one message, the lease protocol of lease mode (Redis or SQL).
 *
 * Mirrors
 *   src/idemq/guard/idempotency.py  Idempotency._process_lease: claim -> judge -> handler ->
 *                                   complete, release when the handler raises
 *   src/idemq/guard/core.py         judge: lost claim -> DUPLICATE / IN_PROGRESS / mismatch
 *   src/idemq/stores/redis/ops.py   claim_set + claim_set_result: SET NX GET first, and the
 *   src/idemq/stores/redis/store.py RedisStore.claim: claim script only for an expired lease
 *   src/idemq/stores/redis/scripts.py  CLAIM (fresh / takeover with the payload check),
 *                                   COMPLETE and RELEASE (both only for the owner's record)
 *   src/idemq/stores/sql/plans.py   Ops.claim (INSERT IGNORE, then sql_takeover), sql_complete
 *   src/idemq/stores/sql/dialects.py  and sql_release (AND status = 0 AND owner = :owner); the
 *                                   one-statement claims of PostgreSQL/SQLite/MariaDB are step
 *                                   2 below alone
 *   renewal: the design of issue 21 (extend iff still the owner), as EXTEND in
 *   src/idemq/lock/scripts.py; the lease store has no renewal yet.
 *
 * Time. Nothing stores absolute times: `left` is lease_until minus the store's now, so the state
 * space stays finite. By default the store sets and judges expiry on its own clock: the code's
 * lease_clock="store" (the default of SqlStore on PostgreSQL/MariaDB/MySQL and of RedisStore:
 * statement_timestamp(), UTC_TIMESTAMP(6), TIME in src/idemq/stores/sql/dialects.py and
 * src/idemq/stores/redis/scripts.py). With -DWORKER_CLOCK it is lease_clock="client" (and
 * SQLite, MemoryStore): each worker writes lease_until = its now + L and judges
 * `lease_until <= its now`, its clock off the store's by a skew in [-S, S] chosen per worker. A request's now_ms is read before its claim round trip; that
 * delay only makes the worker's clock look later-behind, so it is one more skew, not modelled.
 * `own_left` is what the owner was promised: L ticks since its grant or renewal. A tick that runs
 * out a LIVE owner's lease is a fault (the worker was paused, or its handler outran its renewal)
 * and comes from the MAX_OVERRUN budget, as crashes and handler errors come from theirs.
 *
 * Properties (assertions, every run):
 *   fence:     each grant (fresh or takeover) gets an `attempts` greater than every earlier one
 *   exclusive: a lease is taken over only when its live owner's lease has run out
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
 *   -DRELEASE_DELETES   current code: RELEASE deletes the record, so a later fresh claim starts
 *                       attempts at 1 again; the fence repeats (the design keeps the counter)
 *   -DMUTANT_COMPLETE_WITHOUT_OWNER   complete without AND owner = :owner (issue 24)
 *   -DMUTANT_TAKEOVER_ANY_PAYLOAD     takeover without the payload comparison
 */

#ifndef N
#define N 3
#endif
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

byte own_left;          /* ghost: ticks the live owner was promised */
byte max_fence;         /* ghost: the greatest fence granted so far */
byte completions;       /* ghost */
byte crashes, fails, overruns;

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

#ifdef MUTANT_COMPLETE_WITHOUT_OWNER
#define MINE (status == PROCESSING)
#else
#define MINE (status == PROCESSING && owner == w)
#endif

inline grant_fresh() {
  attempts++;   /* the record was absent: 1, unless the counter survived a release */
  fence = attempts;
  status = PROCESSING; owner = w; payload = mine; left = NEW_LEFT; own_left = L;
  printf("w%d claims fresh: fence %d, store lease left %d\n", w, fence, left);
  assert(fence > max_fence); max_fence = fence
}

inline takeover() {
  printf("w%d takes over from %d, who was promised %d more ticks\n", w, owner, own_left);
  assert(owner == NOBODY || own_left == 0);   /* exclusive */
  assert(payload == mine);                    /* payload */
  attempts++;
  fence = attempts; assert(fence > max_fence); max_fence = fence;
  owner = w; left = NEW_LEFT; own_left = L;
  printf("w%d holds fence %d, store lease left %d\n", w, fence, left)
}

/* A crash between two steps: the process dies; its delivery comes back to this worker. */
inline maybe_crash() {
  if
  :: crashes < MAX_CRASH ->
       atomic {
         crashes++; printf("w%d crashes\n", w);
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
  /* 1. claim_set: SET key <record> NX PX gc GET. The pre-check that routes to the script is
   *    the guard's (claim_set_result: PROCESSING and expired), so it uses the same judge. */
  atomic {
    if
    :: status == ABSENT -> grant_fresh(); got = WON
    :: status == PROCESSING && EXPIRED -> got = SCRIPT
    :: else -> got = (status == PROCESSED || payload != mine -> SETTLED : IN_PROGRESS)
    fi
  }
  if
  :: got == SCRIPT ->
       /* 2. the CLAIM script, atomic on the server; the record may have changed since 1. */
       atomic {
         if
         :: status == ABSENT -> grant_fresh(); got = WON
         :: status == PROCESSING && EXPIRED && SAME_PAYLOAD -> takeover(); got = WON
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
  /* the handler runs; the renewal watchdog may extend the lease meanwhile */
  renewals = 0;
  do
  :: renewals < MAX_RENEW ->
       renewals++;
       atomic {
         if
         :: status == PROCESSING && owner == w ->
              left = NEW_LEFT; own_left = L; printf("w%d renews\n", w)
         :: else -> break   /* lost: the handler is told; complete will be refused */
         fi
       }
  :: break
  od;
  if
  :: fails < MAX_FAIL ->   /* the handler raised: release (RELEASE), re-raise, redelivered */
       atomic {
         fails++; printf("w%d handler raises: release\n", w);
         if
         :: status == PROCESSING && owner == w ->
              status = ABSENT; owner = NOBODY; left = 0; own_left = 0;
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
         status = PROCESSED; left = 0; own_left = 0; got = WON
    :: else -> got = IN_PROGRESS; printf("w%d complete refused\n", w)   /* LeaseLostError */
    fi
  }
  if
  :: got == WON -> maybe_crash()   /* after complete, before the ack: redelivered, DUPLICATE */
  :: else -> goto delivery
  fi;
finished:
  skip
}

/* The store's clock. A tick may not run out a live owner's lease unless a fault is spent. */
active proctype clock() {
end_ticking:
  do
  :: atomic {
       status == PROCESSING && (owner == NOBODY || own_left != 1 || overruns < MAX_OVERRUN) ->
       if
       :: owner != NOBODY && own_left == 1 -> overruns++
       :: else -> skip
       fi;
       if :: left > -S -> left-- :: else -> skip fi;
       if :: own_left > 0 -> own_left-- :: else -> skip fi;
       printf("tick: store lease left %d, owner promised %d\n", left, own_left)
     }
  od
}

init {
  byte i;
  atomic {
    for (i : 0 .. N - 1) { run worker(i) }
  }
}

#ifdef LIVENESS
ltl eventually_processed { <> (status == PROCESSED) }
#endif
