for i in 1 2 3; do
 for v in old new; do
  if [ $v = old ]; then export PYTHONPATH=/tmp/old/src; T=/tmp/old/tests; else export PYTHONPATH=/work/main/src; T=/work/main/tests; fi
  for k in "$@"; do echo -n "$v "; sed "s#/work/main/tests#$T#" /tmp/prof/prof_sampling.py > /tmp/prof/p_$v.py; python /tmp/prof/p_$v.py $k 2>&1 | grep ms/; done
 done
done
