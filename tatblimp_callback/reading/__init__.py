"""Reading minimal-pair suites: TatBLiMP's strict reader, other suites' files, JSONL lines."""
