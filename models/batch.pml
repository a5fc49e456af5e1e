/*
 * batch.pml: the transactional batch (process_batch in transactional mode, idemq owning the
 * transaction) on a server that can abort the whole transaction at any statement, with handlers
 * that may swallow a database error. The single message (process) is a batch of one.
 *
 * Mirrors
 *   src/idemq/guard/idempotency.py  Idempotency.process_batch, Idempotency._run
 *   src/idemq/guard/batch_flow.py  batch_flow, _handle_in_transaction, BatchPasses.again
 *   src/idemq/guard/batch_flow.py  HandlerFailedError: the optimistic pass's end
 *   src/idemq/guard/flow.py  run_handler, raise_if_transaction_lost, HandlerFailureIn
 *   src/idemq/guard/flow.py  ConfirmIn, ConfirmManyIn, ConflictRetries.again, message_flow
 *   src/idemq/stores/sql/store.py  SqlStore.transaction, SqlStore.claim_many_in, SqlStore.confirm_in
 *   src/idemq/stores/sql/store.py  SqlStore.confirm_many_in, SqlStore.release_in
 *   src/idemq/stores/sql/store.py  SqlStore.begin_savepoint, SqlStore.end_savepoint
 *   src/idemq/stores/sql/store.py  SqlStoreBase.transaction_lost_by, SqlStore._in_transaction
 *   src/idemq/stores/sql/plans.py  SqlPlans.claim_many, SqlPlans.confirm, SqlPlans.confirm_many, SqlPlans.release_in
 *   src/idemq/errors.py  TransactionLostError, StoreConflictError
 *
 * A pass (one transaction): BEGIN; ClaimManyIn (every dedup row, written PROCESSED); per new
 * message [OpenSavepoint: isolated pass only], the handler, its result written (ConfirmIn with
 * deferred=True: an UPDATE only for a result other than None, the proof left to the end),
 * [CloseSavepoint; ReleaseIn when it raised]; ConfirmManyIn; COMMIT. The optimistic pass
 * has no savepoints: its first raising handler rolls it back and the rerun is isolated (that
 * message FAILED, not run again). A handler's driver error that means the transaction is gone
 * (a deadlock) and any store error fail the whole pass: ROLLBACK, run again, given up after
 * PASS_LIMIT passes (nothing acked, the broker redelivers).
 *
 * The server is MariaDB/InnoDB unless -DPOSTGRES. MariaDB: a deadlock (or lock-wait timeout)
 * rolls back the WHOLE transaction, savepoints included, and the next statement silently opens
 * a new implicit transaction, which COMMIT commits; a savepoint statement then fails (1305).
 * PostgreSQL: an error aborts the transaction: every statement fails until ROLLBACK (TO
 * SAVEPOINT recovers), and COMMIT of an aborted transaction returns normally while the server
 * rolls back (psycopg raises nothing). Any statement may deadlock, or the worker may die at it.
 *
 * Handlers. Each handler writes its effect with one statement; it may raise an error of its own
 * (MAX_RAISE), and it may swallow the error of its statement (MAX_SWALLOW: `try: ... except
 * DBAPIError: pass` without a savepoint of its own) and then return, or write once more (on
 * MariaDB, into the new implicit transaction). Its result is None or not: the result is written
 * only for the latter, by an UPDATE that matches no row without failing.
 *
 * The design (ConfirmIn, issue 30): before COMMIT, prove the transaction still holds the pass's
 * dedup rows; else ROLLBACK and raise TransactionLostError (the pass runs again or the message is
 * retried). PostgreSQL: the connection's transaction status must be INTRANS (an aborted one is
 * INERROR). MariaDB/SQLite: a statement on the rows with this pass's owner token must match every
 * row the pass kept.
 *
 * Properties (assertions):
 *   outcome:  PROCESSED or DUPLICATE only when the message's dedup row and one effect are
 *             committed
 *   once:     no effect committed twice (a duplicate delivery comes for every acked message)
 *   row:      after every COMMIT, no dedup row without its effect
 * Liveness (-DLIVENESS): the broker keeps redelivering what was not acked; with the faults
 * spent, every message is eventually acked.
 *
 * Bounds and why they suffice: three messages (a PROCESSED before the failing statement outlives
 * the rollback, one after it commits without its row: m0 and m2 around m1); two deadlocks, one
 * crash, two handler raises (one ends the optimistic pass, one fails inside the isolated pass),
 * one swallowed error: each failure below needs at most one of each. PASS_LIMIT = 2
 * (CLAIM_ATTEMPTS is 5: more passes only repeat the same pass). One worker: a second one is
 * serialised by the dedup row's lock (it waits for this commit or rollback, then finds the row or
 * not, as a later delivery does), and its deadlocks are the aborts modelled here.
 *
 * Configurations that must fail (the test checks SPIN finds each):
 *   -DNO_CONFIRM        the code before ConfirmIn: COMMIT with no proof the rows are still in
 *                       the transaction. PostgreSQL: PROCESSED, acked, row and effect rolled back.
 *                       MariaDB: the handler's write after the deadlock commits without its row.
 *   -DMUTANT_CARRY_ON   the code before issue 24: an error inside a handle step is that message's
 *                       failure (ROLLBACK TO SAVEPOINT, ReleaseIn, FAILED, carry on)
 */

#define M 3
#ifndef MAX_DEADLOCK
#define MAX_DEADLOCK 2
#endif
#ifndef MAX_CRASH
#define MAX_CRASH 1
#endif
#ifndef MAX_RAISE
#define MAX_RAISE 2
#endif
#ifndef MAX_SWALLOW
#define MAX_SWALLOW 1
#endif
#ifndef PASS_LIMIT
#define PASS_LIMIT 2
#endif
#define BIT(i) (1 << (i))

mtype = { NOTX, OPEN, GONE, ABORTED };           /* the server's transaction */
mtype = { NONE, PROCESSED, DUPLICATE, FAILED };  /* outcomes */
mtype = { CLAIM, SAVEPOINT, WRITE, WRITE_AGAIN, SAVE_RESULT, RELEASE_SAVEPOINT, RELEASE_IN,
          CONFIRM };                             /* statements */

bool row[M];            /* committed dedup rows */
byte eff[M];            /* committed effects */
bool t_row[M];          /* written in the open transaction */
bool t_eff[M];
mtype tx = NOTX;
bool sp;                /* the current message's savepoint exists */
mtype out[M];
bool acked[M];
byte deadlocks, crashes, raises, swallows;

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

/* RELEASE SAVEPOINT / ROLLBACK TO SAVEPOINT: an error when the savepoint is gone (1305). */
inline end_savepoint(undo) {
  atomic {
    if
    :: tx == ABORTED && undo && sp -> tx = OPEN; t_eff[m] = false; sp = false; ok = true
    :: tx == ABORTED -> ok = false
    :: else ->
         if :: tx == GONE -> tx = OPEN :: else -> skip fi;
         if
         :: sp -> if :: undo -> t_eff[m] = false :: else -> skip fi; sp = false; ok = true
         :: else -> ok = false
         fi
    fi
  }
}

inline rollback() { atomic { undo_all(); sp = false; tx = NOTX } }

/* COMMIT: PostgreSQL answers COMMIT of an aborted transaction with ROLLBACK, and the driver
 * returns normally; MariaDB commits whatever the current (maybe implicit) transaction holds. */
inline commit() {
  atomic {
    if
    :: tx == ABORTED -> printf("COMMIT of an aborted transaction: the server rolls back\n")
    :: else ->
         for (i : 0 .. M - 1) {
           if :: t_row[i] -> row[i] = true :: else -> skip fi;
           if :: t_eff[i] -> eff[i]++ :: else -> skip fi
         }
    fi;
    printf("COMMIT: rows %d%d%d, effects %d%d%d\n",
           row[0], row[1], row[2], eff[0], eff[1], eff[2]);
    for (i : 0 .. M - 1) {
      assert(eff[i] <= 1);              /* once */
      assert(!row[i] || eff[i] == 1)    /* row */
    }
    undo_all(); sp = false; tx = NOTX
  }
}

active proctype worker() {
  byte i, m, failures, won, conflicts;
  bool ok, isolated, raised, lost;
  mtype what;

delivery:   /* the broker delivers the batch: what was not acked, and copies of what was */
  if
  :: acked[0] && acked[1] && acked[2] -> goto done
  :: else -> skip
  fi;
  failures = 0; isolated = false; conflicts = 0;

pass:   /* one transaction: BEGIN, ClaimManyIn, handle each, ConfirmIn, COMMIT */
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
         /* the handler: its write, maybe its error swallowed, maybe an error of its own */
         what = WRITE; stmt();
         if
         :: ok -> t_eff[m] = true; printf("m%d: handler writes\n", m)
         :: !ok && swallows < MAX_SWALLOW ->
              swallows++; printf("m%d: handler swallows the error of its write\n", m);
              if
              :: what = WRITE_AGAIN; stmt();
                 if
                 :: ok -> t_eff[m] = true; printf("m%d: handler writes again\n", m)
                 :: else -> goto failed_in_step   /* this one it lets go */
                 fi
              :: skip   /* returns */
              fi
         :: !ok -> goto failed_in_step   /* the driver error goes on: HandlerFailureIn */
         fi;
         raised = false;
         if :: raises < MAX_RAISE -> raises++; raised = true :: skip fi;
         if
         :: raised && !isolated ->   /* HandlerFailedError: roll back, rerun isolated */
              printf("m%d raised: ROLLBACK\n", m); rollback();
              failures = failures | BIT(m); isolated = true; conflicts = 0;
              goto pass
         :: raised && isolated ->    /* CloseSavepoint(commit=False), ReleaseIn: FAILED */
              end_savepoint(true);
              if :: !ok -> goto step_error :: else -> skip fi;
              what = RELEASE_IN; stmt();
              if :: !ok -> goto step_error :: else -> t_row[m] = false fi;
              out[m] = FAILED; printf("m%d raised: rolled back to its savepoint, FAILED\n", m)
         :: else ->
              if
              :: what = SAVE_RESULT; stmt();   /* a result other than None */
                 if :: !ok -> goto failed_in_step :: else -> skip fi
              :: skip                           /* None: the row keeps its null result */
              fi;
              if
              :: isolated -> what = RELEASE_SAVEPOINT; end_savepoint(false);
                 if :: !ok -> goto failed_in_step :: else -> skip fi
              :: else -> skip
              fi;
              out[m] = PROCESSED; printf("m%d: PROCESSED\n", m)
         fi;
         goto next
failed_in_step:   /* a statement of this handle step failed */
#ifdef MUTANT_CARRY_ON
         if
         :: isolated ->   /* the old except: savepoint rollback, release_in, FAILED */
              if
              :: what == WRITE || what == WRITE_AGAIN || what == SAVE_RESULT -> end_savepoint(true)
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
#ifndef NO_CONFIRM
  /* ConfirmIn: the rows this pass kept are still in the transaction, or it is lost */
  what = CONFIRM;
#ifdef POSTGRES
  lost = (tx == ABORTED);   /* the connection's transaction status: INERROR, not INTRANS */
#else
  stmt();
  if :: !ok -> goto conflict :: else -> skip fi;
  lost = false;
  for (i : 0 .. M - 1) {
    if :: out[i] == PROCESSED && !t_row[i] -> lost = true :: else -> skip fi
  }
#endif
  if
  :: lost -> printf("ConfirmIn: the transaction lost its rows: ROLLBACK, TransactionLostError\n");
             goto conflict
  :: else -> skip
  fi;
#endif
  commit();
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

conflict:   /* BatchPasses.again: roll back, rerun or give up */
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
ltl every_message_acked { <> (acked[0] && acked[1] && acked[2]) }
#endif
