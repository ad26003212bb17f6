# run the 2-rank block training N times, with a CPU hog beside it; count failures
N=${N:-12}
fails=0
for i in $(seq $N); do
  rm -rf /tmp/w/st
  PYTHONFAULTHANDLER=1 OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 python -m torch.distributed.run --standalone --nproc-per-node 2 -m diffspec train-drafter --out /tmp/w/st \
   --target /tmp/w/bt/tiny-model0 --data /tmp/w/bt/store0 --kind block --steps 6 --batch-sequences 4 --block-size 4 --anchors 8 --seq-len 64 --layers 1 --lr 3e-3 --train-dtype float32 --eval-prompts 0 --held-out 8 --epochs 100 > /tmp/w/st.log 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then fails=$((fails+1)); cp /tmp/w/st.log /tmp/w/st_fail_$i.log; fi
done
echo "fails $fails of $N"
