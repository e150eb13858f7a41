#!/usr/bin/env bash
# Run here, before a GPU run on the project's device machine, which has PyTorch and transformers but
# neither ../shared nor lm-evaluation-harness, and no network. It puts into .device/ (ignored by git;
# name it in the run's `carry`):
#   - the benchmark, the 48K tokenizer and the Tatar corpus (part 6's multiple-choice text), copied from ../shared
#     (never committed);
#   - wheels of lm-eval 0.4.13 and the packages it needs beyond the device image's (Python 3.12).
# Then, on the device (one call; the lm-eval part is skipped with a note in the JSON if it cannot import):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device/wheels/*.whl;
#   PYTHONPATH=/tmp/site python3 benchmarks/gpu_check.py --device cuda --model-shape 478m \
#       --data .device/test.jsonl --tokenizer .device/kypchak_unigram_48k.model --corpus .device/train.txt \
#       --json $OUT/gpu_check.json
# Part 1b (eager, CUDA graphs, compiled, compiled + graphs; benchmarks/bench_graphs.py) needs nothing beyond the
# image's torch and triton; its two compiled rows take a minute or two each (--speed-rows eager,graphs: without them).
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${SHARED:-../shared}

grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >>.git/info/exclude
mkdir -p .device/wheels
cp "$SHARED/tatblimp/test.jsonl" "$SHARED/tokenizers/kypchak_unigram_48k.model" "$SHARED/tatar-corpus/train.txt" .device/

python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .device/wheels lm-eval==0.4.13 datasets evaluate dill multiprocess more-itertools pytablewriter \
    dataproperty mbstrdecoder pathvalidate tabledata tcolorpy typepy chardet nltk rouge-score defusedxml pytz
# These two are published as source only (pure Python): built into wheels here.
python3 -m pip wheel -q --no-deps -w .device/wheels sqlitedict word2number
du -sh .device
