cd /work/main
for i in 1 2 3; do
  for v in old new; do
    cp /tmp/kx/$v.c src/diffspec/packed_linear.c
    python /tmp/ov/curve.py $v 2>&1 | grep -v ratio | tail -1
  done
done
cp /tmp/kx/new.c src/diffspec/packed_linear.c
