"""What a user of 8 GPUs must know is written where they look: torchrun's 30 s SIGTERM grace next to
the preemption guard, with its fixes, and the memory plan and offload in the README."""

from pathlib import Path

import ddrl.training.preemption as preemption

ROOT = Path(__file__).resolve().parents[2]


def test_torchrun_grace_and_its_fixes_are_documented_next_to_the_guard():
    for text in (preemption.__doc__, (ROOT / "README.md").read_text()):
        assert "30 s" in text and "--signal=TERM@120" in text and "--max-restarts" in text


def test_readme_names_the_dry_run_offload_and_timeout():
    text = (ROOT / "README.md").read_text()
    assert "ddrl train --dry-run" in text and "dist.cpu_offload=true" in text and "dist.timeout" in text
