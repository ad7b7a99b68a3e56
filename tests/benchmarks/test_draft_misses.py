"""benchmarks/draft_misses.py: the first rejected slot of each cycle, found in the output and classed."""

from __future__ import annotations

from utils import REPO_ROOT, loaded_script


def test_first_rejected_slots_are_read_off_the_output_with_skips_and_repeats():
    with loaded_script(REPO_ROOT / "benchmarks" / "draft_misses.py") as script:
        # prompt [0, 1], the prefill's token 10 at index 2 (the first anchor), four cycles of block 4
        sequence = [0, 1, 10, 11, 12, 13, 14, 15, 16, 17, 99]
        cycles = [
            ([11, 12, 30], 2),  # 11, 12 accepted; 30 rejected where the target has 13
            ([15, 16, 17], 0),  # 15 rejected where the target has 14: it is the token after (skipped)
            ([15, 16, 16], 2),  # 15, 16 accepted; 16 again where the target has 17 (repeated)
            ([99, 5, 5], 1),
        ]  # 99 accepted and ends the decode: no rejection recorded
        kept = [3, 1, 3, 1]
        found = [
            (m["slot"], m["target"], m["draft"], m["skipped"], m["repeated"])
            for m in script.misses(sequence, 2, cycles, kept)
        ]
        assert found == [(3, 13, 30, False, False), (1, 14, 15, True, False), (3, 17, 16, False, True)]
        assert script.token_kind(" word", False, False) == "word start"
        assert script.token_kind("ing", False, False) == "word piece"
        assert script.token_kind("ing", False, True) == "word start"  # the first new token
        assert script.token_kind(", ", False, False) == "punctuation"
        assert script.token_kind("<|endoftext|>", True, False) == "end"
