"""A text task any tokenizer can encode, with a dense reward, for 2-step runs on real-format
checkpoints (tests/fixtures/<family>/model): the fraction of completion characters whose code point is even: it does not care which alphabet a
tiny tokenizer has, and a random model's random tokens give varied scores, so every group has an
advantage to follow."""

from ddrl.tasks.user import FunctionTask

TRAIN = ["Say a", "Write the letter a", "a a a", "Repeat: a"]
TEST = ["Say a twice", "Only a"]


def _reward(completions, **columns):
    return [sum(ord(ch) % 2 == 0 for ch in c) / max(len(c), 1) for c in completions]


def make(**kwargs):
    return FunctionTask("letter_a", reward_fn=_reward, train_examples=[{"prompt": p} for p in TRAIN],
                        test_examples=[{"prompt": p} for p in TEST], gen_length=8, **kwargs)
