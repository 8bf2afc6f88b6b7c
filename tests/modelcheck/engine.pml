/*
 * The engine (actors/engine): issues NOPS ops, each one a scheduler could issue now,
 * counts every rank's reports, and handles a Worker group restart and its own restart.
 *
 * Its view of the blocks is the sequential execution of what it issued: ev_dev/ev_host
 * hold the identity the issue order puts in each block (0: nothing known, never read).
 * An op is complete once every rank reported it (each rank counted once; the status is
 * the AND); a failure forgets what the op wrote (if nothing issued later wrote it again).
 * A prefetched host block is read only once the prefetch is complete (pfp), and the
 * ghost check E1 asserts that every rank has finished it by then.
 */

byte ev_dev[ND]; byte ev_host[NH];
byte evw_dev[ND]; byte evw_host[NH];  /* the issue index + 1 of the op behind each view */
byte pfp[NH];                         /* prefetches into the host block not yet complete */
int estored;                          /* keys the engine counts as stored (at issue) */
byte steps_busy;                      /* steps in flight (STEPS at most) */
#if STEPS > 1
byte estep;                           /* the last step issued, + 1 */
#endif
bit ovoid[NOPS];                      /* a step in flight when the step before it failed */
byte eepoch = 1;
byte nissued; byte ncomp;
byte nrep[NOPS]; bit ofail[NOPS]; bit ocomp[NOPS];
bit got[NR * NOPS];                   /* the rank's report of the op was counted */
byte regroup;                         /* Worker ranks of a new generation still to announce */
byte resyncing;                       /* lanes still to answer a new engine's Resync */
byte kd; byte kh;                     /* device / host blocks the engine may read */
byte egen[NR];                        /* each rank's device generation, as its Worker said */

inline known() {
  kd = 0; kh = 0; i = 0;
  do
  :: i < ND -> if :: ev_dev[i] != NOTHING -> kd = kd | BIT(i) :: else fi; i++
  :: else -> break
  od;
  i = 0;
  do
  :: i < NH -> if :: ev_host[i] != NOTHING && pfp[i] == 0 -> kh = kh | BIT(i) :: else fi; i++
  :: else -> break
  od
}

/* x: any set bit of the mask m (m != 0). */
inline pick(m, x) {
  x = 0;
  do
  :: (m >> x) & 1 -> break
  :: ((m >> x) & 1) && (m >> (x + 1)) != 0 -> x++
  :: !((m >> x) & 1) -> x++
  od
}

/* E1: every rank finished every prefetch into host block h issued so far. */
inline prefetched_everywhere(h) {
  j = 0;
  do
  :: j < nissued ->
     if
     :: odir[j] == D_READ && ohost[j] == h ->
        r = 0;
        do
        :: r < NR ->
           if
           :: !fin[r * NOPS + j] && !STALE(r, j) ->
              printf("E1 violated: a read of host block %d issued before rank %d finished prefetch op %d\n", h, r, j);
              assert(false)
           :: else
           fi; r++
        :: else -> break
        od
     :: else
     fi; j++
  :: else -> break
  od
}

inline issue(dir, d, h, rb, key) {
  k = nissued;
  if
  :: dir == D_STEP -> L = STEP
  :: dir == D_IN || dir == D_OUT -> L = SWAP
  :: else -> L = STORE
  fi;
  olane[k] = L; odir[k] = dir; odev[k] = d; ohost[k] = h; okey[k] = key; oep[k] = eepoch;
  rdD[k] = 0; wrD[k] = 0; rdH[k] = 0; wrH[k] = 0;
  if
  :: dir == D_STEP -> wrD[k] = BIT(d); if :: rb < ND -> rdD[k] = BIT(rb) :: else fi
  :: dir == D_IN -> rdH[k] = BIT(h); wrD[k] = BIT(d)
  :: dir == D_OUT -> rdD[k] = BIT(d); wrH[k] = BIT(h)
  :: dir == D_WRITE -> rdH[k] = BIT(h)
  :: dir == D_READ -> wrH[k] = BIT(h)
  fi;
  fence_of(L, rdD[k], wrD[k], rdH[k], wrH[k]);
  lastseq[L]++;
  oseq[k] = lastseq[L];
  record(L, oseq[k], rdD[k], wrD[k], rdH[k], wrH[k]);
  ofs[k * NL + STEP] = f0; ofs[k * NL + SWAP] = f1; ofs[k * NL + STORE] = f2;
  if
  :: dir == D_STEP ->
     if :: rb < ND -> oexp[k] = ev_dev[rb] :: else -> oexp[k] = NOTHING fi;
     ev_dev[d] = k + 1; evw_dev[d] = k + 1;
#if STEPS > 1
     /* Planned while the last step runs: its input may be the token that one samples. */
     if
     :: steps_busy > 0 && !ocomp[estep - 1] -> opend[k] = estep
     :: true
     fi;
     estep = k + 1;
#endif
     steps_busy++
  :: dir == D_IN ->
     prefetched_everywhere(h);
     oexp[k] = ev_host[h]; ev_dev[d] = ev_host[h]; evw_dev[d] = k + 1
  :: dir == D_OUT -> oexp[k] = ev_dev[d]; ev_host[h] = ev_dev[d]; evw_host[h] = k + 1
  :: dir == D_WRITE ->
     prefetched_everywhere(h);
     oexp[k] = ev_host[h]; estored = estored | BIT(key)
  :: dir == D_READ -> oexp[k] = key; ev_host[h] = key; evw_host[h] = k + 1; pfp[h]++
  fi;
  r = 0;
  do
  :: r < NR -> ring[r * NL + L]!k; r++
  :: else -> break
  od;
  nissued++;
  known()
}

/* Op kk is complete (every rank reported, or it was lost in a reset): apply it. */
inline complete(kk) {
  ocomp[kk] = 1; ncomp++;
  if :: ovoid[kk] -> ofail[kk] = 1 :: else fi;  /* voided: dropped, what it wrote forgotten */
  if
  :: odir[kk] == D_STEP -> steps_busy--;
     if
     :: ofail[kk] ->  /* the steps in flight after it are void (Scheduler._void_next) */
        vv = kk + 1;
        do
        :: vv < nissued -> if :: odir[vv] == D_STEP && !ocomp[vv] -> ovoid[vv] = 1 :: else fi; vv++
        :: else -> break
        od
     :: else
     fi
  :: odir[kk] == D_READ -> pfp[ohost[kk]]--
  :: else
  fi;
  if
  :: ofail[kk] ->
     if
     :: (odir[kk] == D_STEP || odir[kk] == D_IN) && evw_dev[odev[kk]] == kk + 1 ->
        ev_dev[odev[kk]] = NOTHING
     :: (odir[kk] == D_OUT || odir[kk] == D_READ) && evw_host[ohost[kk]] == kk + 1 ->
        ev_host[ohost[kk]] = NOTHING
     :: odir[kk] == D_WRITE -> estored = estored & ~BIT(okey[kk])
     :: else
     fi
  :: else
  fi
}

/* Every op issued and not complete is lost (a reset or a restart); ``effects``: apply it
   as failed, as Scheduler.reset_device does; else forget it (a new engine knows nothing). */
inline lose_in_flight(effects) {
  j = 0;
  do
  :: j < nissued ->
     if
     :: !ocomp[j] -> ofail[j] = 1; if :: effects -> complete(j) :: else -> ocomp[j] = 1; ncomp++ fi
     :: else
     fi; j++
  :: else -> break
  od
}

#define CAN_ISSUE (nissued < NOPS && regroup == 0 && resyncing == 0)

proctype engine() {
  byte k, i, j, r, d, h, rb, key, kk, rr, st, ee, dir, L, vv;
  byte f0, f1, f2;
  estored = BIT(PRE);
  known();
  do
  /* Issue an op a scheduler could issue now: choose it, then issue it. */
  :: atomic {
       if
       :: CAN_ISSUE && steps_busy < STEPS -> dir = D_STEP; select(d : 0 .. ND - 1); rb = ND
       :: CAN_ISSUE && steps_busy < STEPS && kd != 0 -> dir = D_STEP; pick(kd, rb); select(d : 0 .. ND - 1)
       :: CAN_ISSUE && kh != 0 -> dir = D_IN; pick(kh, h); select(d : 0 .. ND - 1)
       :: CAN_ISSUE && kd != 0 -> dir = D_OUT; pick(kd, d); select(h : 0 .. NH - 1)
       :: CAN_ISSUE && kh != 0 -> dir = D_WRITE; pick(kh, h); key = ev_host[h]
       :: CAN_ISSUE && estored != 0 -> dir = D_READ; pick(estored, key); select(h : 0 .. NH - 1)
       fi;
       issue(dir, d, h, rb, key);
       d = 0; h = 0; rb = 0; key = 0  /* no chosen value outlives its op (fewer states) */
     }
  /* A report: counted once per rank; an op is complete once every rank reported it. */
  :: atomic { rep?kk, rr, st, ee ->
       if
       :: ee != eepoch || ocomp[kk] || got[rr * NOPS + kk] -> skip  /* stale or a repeat */
       :: else ->
          got[rr * NOPS + kk] = 1; nrep[kk]++;
          if :: st != OK -> ofail[kk] = 1 :: else fi;
#ifdef MUT_FIRST_REPORT
          if :: nrep[kk] == 1 -> complete(kk) :: else fi;
#else
          if :: nrep[kk] == NR -> complete(kk) :: else fi;
#endif
          known()
       fi }
  /* A Worker of a new generation: the first resets the device tier; each rank's swap lane
     is told its new tier before any op of the new epoch. */
  :: atomic { wready?rr, ee, st ->
       egen[rr] = st;
       if
       :: ee > eepoch ->  /* the first rank of a new generation */
          eepoch = ee; regroup = NR - 1;
          lose_in_flight(1);
          steps_busy = 0;
          i = 0;
          do
          :: i < ND -> ev_dev[i] = NOTHING; i++
          :: else -> break
          od;
          i = 0;
          do
          :: i < NH -> pfp[i] = 0; i++
          :: else -> break
          od
       :: ee <= eepoch && regroup > 0 -> regroup--
       :: else  /* a new engine's epoch is past it: nothing to reset */
       fi;
       ring[rr * NL + SWAP]!TIER + st;
       known() }
  /* The engine restarts: a new issuer epoch cancels every op issued before; it knows
     nothing and begins once every executor has answered its Resync. */
  :: atomic { erest < ENGINE_RESTARTS && resyncing == 0 && regroup == 0 && nissued < NOPS ->
       erest++; epoch_ctr++; eepoch = epoch_ctr;
       r = 0;
       do
       :: r < NR -> issuer_ep[r] = eepoch; r++
       :: else -> break
       od;
       lose_in_flight(0);
       steps_busy = 0; estored = BIT(PRE);  /* what storage holds, as a lookup finds it */
       i = 0;
       do
       :: i < ND -> ev_dev[i] = NOTHING; lw_d[i] = 0; la_d[i] = 0; lw_d[ND + i] = 0; la_d[ND + i] = 0; i++
       :: else -> break
       od;
       i = 0;
       do
       :: i < NH -> ev_host[i] = NOTHING; pfp[i] = 0; lw_h[i] = 0; la_h[i] = 0; lw_h[NH + i] = 0; la_h[NH + i] = 0; i++
       :: else -> break
       od;
       i = 0;
       do
       :: i < NL * NL -> prevf[i] = 0; i++
       :: else -> break
       od;
       i = 0;
       do
       :: i < NR * NL -> ring[i]!RESYNC; i++
       :: else -> break
       od;
       resyncing = NR * NL;
       known() }
  /* A Resync answered; the Worker's answer says its tier. Once all answered, the new engine
     tells every swap lane its tier before any op (Executors.tell_tiers, from Engine.begin). */
  :: atomic { acks?i, st ->
       resyncing--;
       if :: i % NL == STEP -> egen[i / NL] = st :: else fi;
       if
       :: resyncing == 0 ->
          r = 0;
          do
          :: r < NR -> ring[r * NL + SWAP]!TIER + egen[r]; r++
          :: else -> break
          od
       :: else
       fi }
  /* Every op issued and complete: the run ends. */
  :: atomic { nissued == NOPS && ncomp == NOPS && regroup == 0 && resyncing == 0 ->
       eng_done = 1; break }
  od
}
