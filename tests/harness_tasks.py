"""Local lm-evaluation-harness tasks for the tests and the benchmark: a BLiMP subset, a multiple-choice JSON task in
the ARC/HellaSwag style (a question and four endings) and a wikitext-style rolling task, all over /work/shared."""

from __future__ import annotations

import json
import random
from pathlib import Path

BLIMP_FILES = ["adjunct_island", "complex_NP_island", "sentential_subject_island"]  # one schema


def write_tasks(
    folder: Path, blimp: Path, corpus: Path, questions: int = 40, documents: int = 12, context_words: int = 0
) -> Path:
    """Write the three tasks (``local_blimp``, ``local_mc``, ``local_rolling``) and their data into ``folder``.

    ``local_mc``'s question is the first half of a corpus line, or with ``context_words`` that many words of the corpus
    from that line on (a long context, which the four endings share)."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [line for line in corpus.read_text(encoding="utf-8").splitlines() if len(line.split()) >= 8][:2000]
    rng = random.Random(0)
    mc = []
    for k in range(questions):
        words = lines[k].split()
        half = len(words) // 2
        wrong = [" ".join(rng.choice(lines[questions:]).split()[2:8]) for _ in range(3)]  # every line has 8 words
        endings = [" ".join(words[half : half + 6]), *wrong]
        label = rng.randrange(4)
        endings[0], endings[label] = endings[label], endings[0]
        question = words[:half]
        if context_words:
            question = " ".join(lines[k : k + context_words // 4]).split()[:context_words]  # lines have 8 words or more
        mc.append({"question": " ".join(question), "endings": endings, "label": label})
    # Documents of several lines: some longer than the tiny models' 256-token context, so that they roll over windows.
    docs = [{"text": " ".join(lines[500 + 9 * k : 500 + 9 * k + 1 + k % 9])} for k in range(documents)]
    (folder / "mc.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in mc), encoding="utf-8")
    (folder / "docs.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in docs), encoding="utf-8")
    blimp_files = ", ".join(str(blimp / f"{name}.jsonl") for name in BLIMP_FILES)
    (folder / "local_blimp.yaml").write_text(
        "task: local_blimp\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: [{blimp_files}]\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: ''\ndoc_to_target: 0\n"
        'doc_to_choice: "{{[sentence_good, sentence_bad]}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    (folder / "local_mc.yaml").write_text(
        "task: local_mc\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{endings}}"\ndoc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n"
    )
    (folder / "local_rolling.yaml").write_text(
        "task: local_rolling\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'docs.jsonl'}\n"
        "test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ''\n"
        'doc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
    )
    return folder
