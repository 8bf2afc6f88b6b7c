/*
 * The prefill/decode hand-over as a Promela model (docs/design.md, "Instances (prefill/decode
 * disaggregation)"; actors/router, actors/serve/router_api.py, actors/engine/disaggregation.py):
 * for each of NREQ requests a router reserves room on the decode instance, has the prefill instance compute the prompt and
 * write its K blocks to the shared tier, then claims the reservation; the decode instance
 * prefetches the blocks (a miss is computed again) and streams.
 *
 * The prefill instance answers only once its store lane's watermark covers the writes;
 * a stored block becomes visible only whole (atomic rename) and carries a checksum, so a
 * corrupt one reads as a miss. Faults (-D budgets): the prefill instance dies
 * (PREFILL_DEATHS), its store lane crashes mid write and redoes it (STORE_CRASHES), the
 * tier loses everything (REDIS_RESTARTS) or a stored block is corrupted (CORRUPTIONS), a
 * client leaves after its reservation (DROPS), the decode instance dies mid request
 * (DECODE_DEATHS). The router's prefill deadline and the reservation's expiry are timers:
 * either may fire at any moment.
 *
 * Properties: D1 a decode reads as data only whole, intact blocks; D2 once the router
 * heard "prefilled", every block the prefill reported stored is whole in the tier (unless
 * the tier lost it since); D3 no reservation outlives its request (checked at the end);
 * the decode instance never holds more than its room; no invalid end state; and the LTL
 * claim `pd_done`: every request ends (answered, or an error) under weak fairness.
 *
 * Mutants (-D): MUT_EARLY_ANSWER, MUT_TORN_WRITE, MUT_NO_EXPIRY, MUT_NO_DEADLINE.
 */

#ifndef NREQ
#define NREQ 1
#endif
#ifndef K
#define K 2
#endif
#ifndef ROOM
#define ROOM 1
#endif
#ifndef PREFILL_DEATHS
#define PREFILL_DEATHS 1
#endif
#ifndef STORE_CRASHES
#define STORE_CRASHES 1
#endif
#ifndef REDIS_RESTARTS
#define REDIS_RESTARTS 1
#endif
#ifndef CORRUPTIONS
#define CORRUPTIONS 1
#endif
#ifndef DROPS
#define DROPS 1
#endif
#ifndef DECODE_DEATHS
#define DECODE_DEATHS 1
#endif
#define MAX_CLAIMS 2
#define RESERVE_TRIES 2

/* A stored block. */
#define ABSENT 0
#define WHOLE 1
#define TORN 2     /* visible half written (only where writes are not atomic) */
#define CORRUPT 3  /* its checksum no longer matches */

/* Answers. */
#define GRANTED 1
#define NO_ROOM 2
#define STREAMED 3
#define EXPIRED 4
#define DIED 5
#define PREFILLED 6
#define REFUSED 7

/* A reservation. */
#define R_NONE 0
#define R_HELD 1
#define R_CLAIMED 2

byte stor[NREQ * K];
byte rsv[NREQ];
byte reserved;   /* reservations the decode instance holds (R_HELD) */
byte running;    /* claimed requests it runs */
bit prefilled[NREQ];  /* the router heard "prefilled" for the request */
bit lost;        /* the tier lost or damaged a block since the run began */
bit ended[NREQ];
byte ndone;
bit pdead;       /* the prefill instance is dead */
bit pstopped;    /* the prefill instance stopped (the run is over) */
byte pwm;        /* the prefill store lane's watermark: writes done */
byte pissued;    /* writes the prefill instance issued */
byte deaths; byte crashes; byte restarts; byte corruptions; byte drops; byte ddeaths;

chan to_decode = [2 * NREQ] of { byte, byte };   /* kind (GRANTED: reserve, STREAMED: claim), req */
chan dec_reply[NREQ] = [2] of { byte };
chan to_prefill = [NREQ] of { byte };
chan pf_reply[NREQ] = [2] of { byte };           /* buffered: a late answer never blocks */
chan pstore = [NREQ * K] of { byte };           /* the prefill store lane's ring of block indexes */

#define ALL_DONE (ndone == NREQ)

proctype decode() {
  byte kind, q, b, hits, v;
  do
  :: to_decode?kind, q ->
     if
     :: kind == GRANTED ->  /* a reserve: room beside what running requests hold */
        if
        :: reserved + running < ROOM -> rsv[q] = R_HELD; reserved++; dec_reply[q]!GRANTED
        :: else -> dec_reply[q]!NO_ROOM
        fi
     :: kind == STREAMED ->  /* a claim */
        if
        :: rsv[q] == R_HELD ->
           rsv[q] = R_CLAIMED; reserved--; running++;
           assert(reserved + running <= ROOM);
           hits = 0; b = 0;
           do
           :: b < K ->
              v = stor[q * K + b];  /* the bytes read: checked, then used */
              if
#ifdef MUT_TORN_WRITE
              :: v != ABSENT ->  /* read without its checksum */
#else
              :: v == WHOLE ->
#endif
                 if
                 :: v != WHOLE ->
                    printf("D1 violated: request %d read block %d as data, and it is not whole\n", q, b);
                    assert(false)
                 :: else
                 fi;
                 hits++
              :: else  /* a miss: computed again */
              fi;
              b++
           :: else -> break
           od;
           if
           :: prefilled[q] && !lost && hits < K ->
              printf("D2 violated: request %d was prefilled but %d of its %d blocks are not in the tier\n", q, K - hits, K);
              assert(false)
           :: else
           fi;
           if
           :: ddeaths < DECODE_DEATHS ->  /* dies mid request: a new instance holds nothing */
              ddeaths++; running = 0; reserved = 0;
              b = 0;
              do
              :: b < NREQ -> rsv[b] = R_NONE; b++
              :: else -> break
              od;
              dec_reply[q]!DIED
           :: true -> running--; rsv[q] = R_NONE; dec_reply[q]!STREAMED
           fi
        :: else -> dec_reply[q]!EXPIRED
        fi
     fi
#ifndef MUT_NO_EXPIRY
  :: atomic {  /* an unclaimed reservation's timer */
       (rsv[0] == R_HELD) -> rsv[0] = R_NONE; reserved-- }
#if NREQ > 1
  :: atomic { (rsv[1] == R_HELD) -> rsv[1] = R_NONE; reserved-- }
#endif
#endif
  :: ALL_DONE && empty(to_decode) && reserved == 0 -> break
#ifdef MUT_NO_EXPIRY
  :: ALL_DONE && empty(to_decode) -> break
#endif
  od;
  if
  :: reserved != 0 ->
     printf("D3 violated: %d reservation(s) outlived their requests\n", reserved);
     assert(false)
  :: else
  fi
}

proctype prefill() {
  byte q, b, mark;
  do
  :: to_prefill?q ->
     if
     :: pdead -> pf_reply[q]!REFUSED  /* nothing listens: connection refused */
     :: else ->
        b = 0;
        do
        :: b < K -> pstore!q * K + b; pissued++; b++
        :: else -> break
        od;
        mark = pissued;
        if
        :: deaths < PREFILL_DEATHS -> deaths++; pdead = 1  /* dies holding the answer */
        :: true ->
#ifndef MUT_EARLY_ANSWER
           (pwm >= mark || pdead);  /* the answer waits for the writes */
#endif
           pf_reply[q]!PREFILLED
        fi
     fi
  :: ALL_DONE && empty(to_prefill) -> break
  od;
  pstopped = 1
}

/* The prefill instance's store lane: each write in order, visible whole (a rename); a
   crash mid write leaves nothing visible and the next incarnation redoes it. */
proctype store_lane() {
  byte key;
  do
  :: pdead -> break  /* it died with its instance: writes in its ring are lost */
  :: !pdead && pstore?[key] -> pstore?<key>;
#ifdef MUT_TORN_WRITE
     stor[key] = TORN;
#endif
     if
     :: crashes < STORE_CRASHES -> crashes++  /* redone from the ring */
     :: true -> stor[key] = WHOLE; pwm++; pstore?key
     fi
  :: pstopped && empty(pstore) -> break  /* after its instance's last write */
  od
}

/* The tier's faults: redis restarts (every block gone), a block's bytes damaged. */
proctype tier() {
  byte b;
  do
  :: restarts < REDIS_RESTARTS && !ALL_DONE ->
     atomic {
       restarts++; lost = 1; b = 0;
       do
       :: b < NREQ * K -> stor[b] = ABSENT; b++
       :: else -> break
       od }
  :: corruptions < CORRUPTIONS && !ALL_DONE ->
     atomic {  /* some whole block's bytes, or none */
       b = 0;
       do
       :: b < NREQ * K && stor[b] == WHOLE -> corruptions++; lost = 1; stor[b] = CORRUPT; break
       :: b < NREQ * K -> b++
       :: else -> break
       od }
  :: ALL_DONE -> break
  od
}

proctype router(byte q) {
  byte answer, tries, claims;
reserve:
  tries = 0;
  do
  :: to_decode!GRANTED, q; dec_reply[q]?answer;
     if
     :: answer == GRANTED -> break
     :: answer == NO_ROOM && tries + 1 < RESERVE_TRIES -> tries++  /* waits, then again */
     :: else -> goto finish  /* 503 no_room */
     fi
  od;
  if
  :: claims == 0 ->  /* prefill once; a second reservation reuses the blocks */
     if
     :: drops < DROPS -> drops++; goto finish  /* the client left: no claim */
     :: true
     fi;
     to_prefill!q;
     if
     :: pf_reply[q]?answer -> prefilled[q] = (answer == PREFILLED)
#ifndef MUT_NO_DEADLINE
     :: true -> skip  /* the prefill deadline passed: the decode instance computes */
#endif
     fi
  :: else
  fi;
  claims++;
  to_decode!STREAMED, q; dec_reply[q]?answer;
  if
  :: answer == EXPIRED && claims < MAX_CLAIMS -> goto reserve
  :: else  /* streamed, an error (decode died), or expired too often: a 503 */
  fi;
finish:
  atomic { ended[q] = 1; ndone++ }
}

init {
  byte q;
  atomic {
    run decode(); run prefill(); run store_lane(); run tier();
    q = 0;
    do
    :: q < NREQ -> run router(q); q++
    :: else -> break
    od
  }
}

ltl pd_done { <> ALL_DONE }
