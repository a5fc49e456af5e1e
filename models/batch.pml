/*
 * batch.pml: the transactional batch (process_batch in transactional mode, idemq owning the
 * transaction) on a server that can abort the whole transaction at any statement.
 *
 * Mirrors
 *   src/idemq/guard/idempotency.py  Idempotency._process_batch (the pass loop), _batch_in (one
 *                                   pass, one transaction), _handle_in (a message; isolated: in
 *                                   a savepoint, release_in when it raised)
 *   src/idemq/guard/batch_flow.py   batch_flow (claim all, judge, handle in order; optimistic:
 *                                   the first raising handler ends the pass), BatchPasses.again
 *                                   (a handler error -> rerun isolated, that message FAILED and not
 *                                   run again; a conflict -> rerun, at most CLAIM_ATTEMPTS times)
 *   src/idemq/stores/sql/store.py   SqlStore.savepoint (SAVEPOINT / ROLLBACK TO / RELEASE),
 *                                   _OwnTransaction (BEGIN ... COMMIT or ROLLBACK)
 *   src/idemq/stores/sql/plans.py   Ops.claim_many (one multi-row INSERT for the batch),
 *                                   save_result, release_in
 *
 * The server is MariaDB/InnoDB unless -DPOSTGRES: a deadlock (or lock-wait timeout) rolls back
 * the WHOLE transaction, savepoints included, and the next statement silently opens a new
 * implicit transaction, which the final COMMIT commits; ROLLBACK TO SAVEPOINT then fails (1305).
 * PostgreSQL instead marks the transaction aborted: every statement fails until ROLLBACK (TO
 * SAVEPOINT, which recovers). Any statement may deadlock, or the worker may die at it (the
 * server rolls back; the batch is redelivered).
 *
 * The design (the fixed rule of issue 24): any error meaning the transaction is gone aborts the
 * whole pass; it is rolled back and rerun (given up after PASS_LIMIT passes: nothing acked, the
 * broker redelivers). -DMUTANT_CARRY_ON is the code before that rule: an error inside a handle
 * step is that message's failure; isolated, ROLLBACK TO SAVEPOINT is tried, release_in runs, the
 * message is FAILED and the pass carries on.
 *
 * Properties (assertions):
 *   outcome:  PROCESSED or DUPLICATE only when the message's effect and dedup row are committed
 *   together: after every COMMIT, a message has a committed dedup row iff it has a committed
 *             effect (no effect without its row, no row without its effect)
 *   once:     no effect committed twice
 * Liveness (-DLIVENESS): the broker keeps redelivering what was not acked; with the faults
 * spent, both good messages are eventually acked.
 *
 * Bounds and why they suffice: three messages, m1 a poison whose handler writes then raises, so
 * every delivery reaches the isolated rerun; the bug needs a message before the failing
 * statement (its PROCESSED outcome outlives the rollback) and one after it (committed without
 * its row), so m0 and m2; m2 also raises once (a second poison, caught inside the rerun). Two
 * deadlocks, one crash: each failure needs one; the second deadlock reaches the PASS_LIMIT
 * give-up. PASS_LIMIT = 2 (CLAIM_ATTEMPTS is 5: more passes only repeat the same pass).
 * One worker: a second one is serialised by the dedup row's lock (it waits for this commit or
 * rollback, then finds the row or not, as a later delivery would), and its deadlocks are the
 * aborts modelled here.
 */

#define M 3
#define POISON 1
#define FLAKY 2
#ifndef MAX_DEADLOCK
#define MAX_DEADLOCK 2
#endif
#ifndef MAX_CRASH
#define MAX_CRASH 1
#endif
#ifndef MAX_FLAKY
#define MAX_FLAKY 1
#endif
#ifndef PASS_LIMIT
#define PASS_LIMIT 2
#endif
#define BIT(i) (1 << (i))

mtype = { NOTX, OPEN, GONE, ABORTED };           /* the server's transaction */
mtype = { NONE, PROCESSED, DUPLICATE, FAILED };  /* outcomes */
mtype = { CLAIM, SAVEPOINT, WRITE, SAVE_RESULT, RELEASE_SAVEPOINT, RELEASE_IN };  /* statements */

bool row[M];            /* committed dedup rows */
byte eff[M];            /* committed effects */
bool t_row[M];          /* written in the open transaction */
bool t_eff[M];
mtype tx = NOTX;
bool sp;                /* the current message's savepoint exists */
mtype out[M];
bool acked[M];
byte deadlocks, crashes, flakes;

inline undo_all() {
  for (i : 0 .. M - 1) { t_row[i] = false; t_eff[i] = false }
}

inline server_deadlock() {
  deadlocks++;
  printf("deadlock at %e\n", what);
#ifdef POSTGRES
  tx = ABORTED          /* undone by ROLLBACK TO SAVEPOINT or ROLLBACK */
#else
  undo_all(); sp = false; tx = GONE    /* InnoDB rolled the whole transaction back */
#endif
}

/* One statement inside the transaction: ok, or an error (the transaction is gone or aborted). */
inline stmt() {
  atomic {
    if :: tx == GONE -> tx = OPEN :: else -> skip fi;   /* MariaDB: a new implicit transaction */
    if
    :: tx == ABORTED -> ok = false
    :: tx == OPEN && deadlocks < MAX_DEADLOCK -> server_deadlock(); ok = false
    :: tx == OPEN && crashes < MAX_CRASH ->
         crashes++; printf("worker dies at %e\n", what); undo_all(); sp = false; tx = NOTX;
         ok = false; goto delivery
    :: tx == OPEN -> ok = true
    fi
  }
}

inline rollback_to_savepoint() {
  atomic {
    if :: tx == GONE -> tx = OPEN :: else -> skip fi;
    if
    :: sp -> t_eff[m] = false; sp = false; tx = OPEN; ok = true   /* undoes m's writes */
    :: else -> ok = false                                       /* 1305: no such savepoint */
    fi
  }
}

inline rollback() { atomic { undo_all(); sp = false; tx = NOTX } }

inline commit() {
  atomic {
    if
    :: tx == ABORTED -> undo_all(); ok = false   /* PostgreSQL answers COMMIT with ROLLBACK */
    :: else ->
         for (i : 0 .. M - 1) {
           if :: t_row[i] -> row[i] = true :: else -> skip fi;
           if :: t_eff[i] -> eff[i]++ :: else -> skip fi
         }
         printf("COMMIT: rows %d%d%d, effects %d%d%d\n",
                row[0], row[1], row[2], eff[0], eff[1], eff[2]);
         for (i : 0 .. M - 1) {
           assert(eff[i] <= 1);                /* once */
           assert(row[i] == (eff[i] > 0))      /* together */
         }
         undo_all(); ok = true
    fi;
    sp = false; tx = NOTX
  }
}

active proctype worker() {
  byte i, m, failures, won, conflicts;
  bool ok, isolated, raised;
  mtype what;

delivery:   /* the broker delivers the batch: what was not acked, and copies of what was */
  if
  :: acked[0] && acked[2] -> goto done
  :: else -> skip
  fi;
  failures = 0; isolated = false; conflicts = 0;

pass:   /* _batch_in: BEGIN, claim_many_in, handle each, COMMIT */
  for (i : 0 .. M - 1) { out[i] = NONE }
  tx = OPEN; won = 0;
  if
  :: isolated -> printf("BEGIN, isolated pass\n")
  :: else -> printf("BEGIN, optimistic pass\n")
  fi;
  what = CLAIM; stmt();   /* claim_many_in: the multi-row INSERT (+ SELECT of the lost rows) */
  if :: !ok -> goto conflict :: else -> skip fi;
  for (i : 0 .. M - 1) {
    if
    :: failures & BIT(i) -> out[i] = FAILED   /* not claimed, not run again */
    :: row[i] -> out[i] = DUPLICATE
    :: else -> t_row[i] = true; won = won | BIT(i)
    fi
  }
  for (m : 0 .. M - 1) {
    if
    :: won & BIT(m) ->
         if
         :: isolated -> what = SAVEPOINT; stmt();
            if :: ok -> sp = true :: else -> goto failed_in_step fi
         :: else -> skip
         fi;
         what = WRITE; stmt();   /* the handler's write */
         if
         :: !ok -> goto failed_in_step
         :: else -> t_eff[m] = true; printf("m%d: handler writes\n", m)
         fi;
         raised = (m == POISON);
         if :: m == FLAKY && flakes < MAX_FLAKY -> flakes++; raised = true :: else -> skip fi;
         if
         :: raised && !isolated ->   /* HandlerFailedError: roll back, rerun isolated */
              printf("m%d raised: ROLLBACK\n", m); rollback();
              failures = failures | BIT(m); isolated = true; conflicts = 0;
              goto pass
         :: raised && isolated ->    /* ROLLBACK TO SAVEPOINT, release_in: FAILED */
              rollback_to_savepoint();
              if :: !ok -> goto step_error :: else -> skip fi;
              what = RELEASE_IN; stmt();
              if :: !ok -> goto step_error :: else -> t_row[m] = false fi;
              out[m] = FAILED; printf("m%d raised: rolled back to its savepoint, FAILED\n", m)
         :: else ->
              what = SAVE_RESULT; stmt();
              if :: !ok -> goto failed_in_step :: else -> skip fi;
              if
              :: isolated -> what = RELEASE_SAVEPOINT; stmt();
                 if :: ok -> sp = false :: else -> goto failed_in_step fi
              :: else -> skip
              fi;
              out[m] = PROCESSED; printf("m%d: PROCESSED\n", m)
         fi;
         goto next
failed_in_step:   /* a statement of this handle step failed */
#ifdef MUTANT_CARRY_ON
         if
         :: isolated ->   /* _handle_in's except: savepoint rollback, release_in, FAILED */
              if   /* savepoint()'s except clause runs only for an error inside its body */
              :: what == WRITE || what == SAVE_RESULT -> rollback_to_savepoint()
              :: else -> skip
              fi;
              what = RELEASE_IN; stmt();   /* in whatever transaction there is now */
              if :: ok -> t_row[m] = false :: else -> goto step_error fi;
              out[m] = FAILED; printf("m%d: FAILED, carrying on\n", m); goto next
         :: else ->       /* optimistic: taken for the handler's failure */
              rollback(); failures = failures | BIT(m); isolated = true; conflicts = 0;
              goto pass
         fi;
#endif
step_error:
         goto conflict
next:    skip
    :: else -> skip
    fi
  }
  commit();
  if :: !ok -> goto conflict :: else -> skip fi;
  for (i : 0 .. M - 1) {   /* the outcomes returned: acked if PROCESSED or DUPLICATE */
    if
    :: out[i] == PROCESSED || out[i] == DUPLICATE ->
         printf("outcome m%d: %e\n", i, out[i]);
         assert(row[i] && eff[i] == 1);   /* outcome */
    :: else -> skip
    fi
  }
  if   /* dies after COMMIT, before the acks: the whole batch is redelivered */
  :: crashes < MAX_CRASH -> crashes++; goto delivery
  :: true -> skip
  fi;
  for (i : 0 .. M - 1) {
    if :: out[i] == PROCESSED || out[i] == DUPLICATE -> acked[i] = true :: else -> skip fi
  }
  goto delivery

conflict:   /* BatchPasses.again(StoreConflictError): roll back, rerun or give up */
  rollback();
  conflicts++;
  if
  :: conflicts < PASS_LIMIT -> printf("transaction gone: ROLLBACK, run the pass again\n"); goto pass
  :: else -> printf("transaction gone: ROLLBACK, given up\n"); goto delivery   /* not acked */
  fi;

done:
  skip
}

#ifdef LIVENESS
ltl good_messages_acked { <> (acked[0] && acked[2]) }
#endif
