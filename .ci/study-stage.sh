export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
S=/tmp/study; mkdir -p $S
run() { t=$1; shift; timeout $t python3 compare.py --no-progress "$@"; }
run 230 --suite prefill --keep-going --json $S/prefill.json --plot $S/prefill.png > $S/prefill.md 2>&1
run 40 --suite decode --graph --keep-going --json $S/decode.json > $S/decode.md 2>&1
for s in gqa qkv partial interleaved positions varlen; do
  run 40 --suite $s --keep-going --json $S/$s.json > $S/$s.md 2>&1
done
run 40 --accuracy --only study "torch.compile(hf_rotate_half)" > $S/accuracy.md 2>&1
python3 compare.py --design $S/prefill.json > $S/design.md 2>&1
cd $S && tar czf $OUT/study.tgz . && ls
