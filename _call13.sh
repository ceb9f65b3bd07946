source ci/gpu_setup.sh
python3 -m mla_dispatch build 2>&1 | tail -1
python3 -m pytest -m gpu -q -n 4 -p no:cacheprovider tests/test_cuda_sm90.py 2>&1 | tail -1
cd ci && python3 bench_cuda_sm90.py --groups fp8t --variants 0 --json $OUT/call13_h200.json 2>&1 | grep "fp8t \|peaks"
date -u
