/*
 * Table mode (-DTABLE): the ops of table.pml, recorded from the real scheduler with the
 * fences cache/fences.py gave them, issued in their order through the model's fence rule
 * (fence_of, record). F: every fence the model computes equals the recorded one.
 */

int t_lane[TN]; int t_seq[TN]; int t_rdD[TN]; int t_wrD[TN]; int t_rdH[TN]; int t_wrH[TN];
int t_f[TN * NL];

init {
  int k, i, L, f0, f1, f2;
  d_step { fill_table() }
  k = 0;
  do
  :: k < TN ->
     L = t_lane[k];
     fence_of(L, t_rdD[k], t_wrD[k], t_rdH[k], t_wrH[k]);
     lastseq[L]++;
     assert(lastseq[L] == t_seq[k]);
     record(L, lastseq[L], t_rdD[k], t_wrD[k], t_rdH[k], t_wrH[k]);
     if
     :: f0 != t_f[k * NL + STEP] || f1 != t_f[k * NL + SWAP] || f2 != t_f[k * NL + STORE] ->
        printf("F violated: table op %d (lane %d, number %d): the model's fence is step %d swap %d store %d, cache/fences.py's step %d swap %d store %d\n",
               k, L, t_seq[k], f0, f1, f2, t_f[k * NL + STEP], t_f[k * NL + SWAP], t_f[k * NL + STORE]);
        assert(false)
     :: else
     fi;
     k++
  :: else -> break
  od;
  printf("F holds: %d fences equal\n", TN)
}
