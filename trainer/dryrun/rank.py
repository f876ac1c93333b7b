"""One process of the dry run: `python -m trainer.dryrun.rank` takes a JSON list of jobs on
stdin and prints one JSON report per job (one rank each) on stdout, running them one after
another (trainer/dryrun/dry_rank.py). The fake devices must be loaded before torch is
imported, so this entry imports nothing of torch at its top.
"""

import json
import sys

from trainer.dryrun.fake_cuda import load_fake_cuda


def main():
    jobs = json.load(sys.stdin)
    load_fake_cuda(max(job["gpus_per_node"] for job in jobs))
    from trainer.dryrun.dry_rank import run_job  # imports torch: only now, over the fake devices

    for job in jobs:
        print(json.dumps(run_job(job)), flush=True)


if __name__ == "__main__":
    main()
