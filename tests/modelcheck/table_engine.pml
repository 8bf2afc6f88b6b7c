/*
 * Table mode (-DTABLE): the ops of table.pml, recorded from the real scheduler with the
 * fences cache/fences.py gave them (and the tier resets of Worker restarts between them),
 * issued in their order through the model's fence rule (fence_of, record).
 *
 * F, safety: each recorded fence covers what its op's own blocks need, lane by lane: the
 * model's rule without its monotone floor, i.e. the last op of the other lane that wrote a
 * block it reads or used a block it writes. A recorded fence above the model's rule (with
 * its floor) is counted as over-fencing, not failed: it costs waiting, never a wrong token.
 * So a stronger rule, or one without the floor, passes; one that lets a conflicting pair
 * run out of issue order fails, naming the op.
 */

int t_lane[TN]; int t_seq[TN]; int t_rdD[TN]; int t_wrD[TN]; int t_rdH[TN]; int t_wrH[TN];
int t_f[TN * NL]; byte t_rst[TN];

inline forget_tier(lw, la, n) {
  i = 0;
  do
  :: i < 2 * n -> lw[i] = 0; la[i] = 0; i++
  :: else -> break
  od
}

init {
  int k, i, L, f0, f1, f2, n0, n1, n2, p0, p1, p2, over;
  d_step { fill_table() }
  k = 0; over = 0;
  do
  :: k < TN ->
     L = t_lane[k];
     /* A Worker restart before this op: the tier's older ops are all cancelled. */
     if :: t_rst[k] & 1 -> forget_tier(lw_d, la_d, ND) :: else fi;
     if :: t_rst[k] & 2 -> forget_tier(lw_h, la_h, NH) :: else fi;
     /* What the op's blocks need: the rule with the lane's floor set aside. */
     p0 = prevf[L * NL + STEP]; p1 = prevf[L * NL + SWAP]; p2 = prevf[L * NL + STORE];
     prevf[L * NL + STEP] = 0; prevf[L * NL + SWAP] = 0; prevf[L * NL + STORE] = 0;
     fence_of(L, t_rdD[k], t_wrD[k], t_rdH[k], t_wrH[k]);
     n0 = f0; n1 = f1; n2 = f2;
     prevf[L * NL + STEP] = p0; prevf[L * NL + SWAP] = p1; prevf[L * NL + STORE] = p2;
     /* The model's own fence: the need, raised to the lane's floor. */
     maxto(f0, p0); maxto(f1, p1); maxto(f2, p2);
     lastseq[L]++;
     assert(lastseq[L] == t_seq[k]);
     record(L, lastseq[L], t_rdD[k], t_wrD[k], t_rdH[k], t_wrH[k]);
     if
     :: t_f[k * NL + STEP] < n0 || t_f[k * NL + SWAP] < n1 || t_f[k * NL + STORE] < n2 ->
        printf("F violated: table op %d (lane %d, number %d): cache/fences.py's fence is step %d swap %d store %d, below what its blocks need: step %d swap %d store %d\n",
               k, L, t_seq[k], t_f[k * NL + STEP], t_f[k * NL + SWAP], t_f[k * NL + STORE], n0, n1, n2);
        assert(false)
     :: else
     fi;
     if
     :: t_f[k * NL + STEP] > f0 || t_f[k * NL + SWAP] > f1 || t_f[k * NL + STORE] > f2 -> over++
     :: else
     fi;
     k++
  :: else -> break
  od;
  printf("F holds: %d fences cover what their blocks need; %d above the model's rule\n", TN, over)
}
