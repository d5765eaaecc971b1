"""Model-based rewards on tiny, randomly initialised models built here (no downloads)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddrl.rewards.image import encode_image
from ddrl.rewards.model_based import ClipStyleImageReward, HFSequenceClassifierReward, ModelReward

WORDS = ["the", "answer", "is", "good", "bad", "four", "two", "plus", "question", "what"]


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    vocab = {w: i for i, w in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="[CLS]", sep_token="[SEP]")


def tiny_bert(num_labels: int):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(WORDS) + 4, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=64, num_labels=num_labels,
                        hidden_dropout_prob=0.3, attention_probs_dropout_prob=0.3, initializer_range=0.5)
    return BertForSequenceClassification(config)


TEXTS = ["the answer is four", "bad", "what is two plus two", "", "the the the the the the the"]


@pytest.fixture(scope="module")
def bert_parts():
    return tiny_bert(1), tiny_bert(2), tiny_tokenizer()


def manual_scores(model, tok, texts, prompts=None, label=None):
    model.eval()
    with torch.no_grad():
        out = []
        for i, t in enumerate(texts):
            # lists, because a lone empty text_pair "" is read by HF tokenizers as "no pair"
            enc = tok([prompts[i]], [t], return_tensors="pt") if prompts else tok([t], return_tensors="pt")
            logits = model(**enc).logits[0]
            out.append(logits[0].item() if logits.numel() == 1 else logits.softmax(-1)[label].item())
    return out


def test_hf_reward_matches_unbatched_forward_passes(bert_parts):
    one, two, tok = bert_parts
    one.train()  # dropout on: the reward must switch to eval mode, then restore the mode
    reward = HFSequenceClassifierReward(one, tok, batch_size=2, use_prompt=False)
    scores = reward(TEXTS)
    assert one.training
    assert scores == pytest.approx(manual_scores(one, tok, TEXTS), abs=1e-5)
    assert scores == reward(TEXTS)  # deterministic: dropout was off
    probs = HFSequenceClassifierReward(two, tok, batch_size=3, label=0)(TEXTS, prompt=["question"] * 5)
    assert probs == pytest.approx(manual_scores(two, tok, TEXTS, ["question"] * 5, label=0), abs=1e-5)
    assert all(0.0 <= p <= 1.0 for p in probs)
    assert all(p.grad is None for p in one.parameters())


def test_hf_reward_uses_the_prompt_as_a_text_pair(bert_parts):
    one, _, tok = bert_parts
    reward = HFSequenceClassifierReward(one, tok)
    with_prompt = reward(TEXTS[:3], prompt=["what is two plus two"] * 3)
    assert with_prompt == pytest.approx(manual_scores(one, tok, TEXTS[:3], ["what is two plus two"] * 3), abs=1e-5)
    assert with_prompt != pytest.approx(reward(TEXTS[:3]), abs=1e-3)


def test_hf_reward_loads_a_saved_directory(tmp_path, bert_parts):
    one, _, tok = bert_parts
    one.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded = HFSequenceClassifierReward(str(tmp_path), use_prompt=False)
    assert loaded(TEXTS) == pytest.approx(manual_scores(one, tok, TEXTS), abs=1e-5)


def test_hf_reward_survives_junk(bert_parts):
    one, _, tok = bert_parts
    reward = HFSequenceClassifierReward(one, tok, max_length=32, batch_size=4)
    junk = ["x" * 1_000_000, "\ud800 broken surrogate", "", "the answer " * 10_000, "good"]
    scores = reward(junk, prompt=["what"] * 5)
    assert len(scores) == 5 and all(isinstance(s, float) for s in scores)
    assert scores[4] == pytest.approx(manual_scores(one, tok, ["good"], ["what"])[0], abs=1e-5)


class FlakyReward(ModelReward):
    """Scores len(text); fails on "boom"; records the batch sizes it saw."""

    def __init__(self):
        super().__init__(batch_size=3)
        self.scale = nn.Parameter(torch.ones(()))
        self.batches = []

    def score_batch(self, completions, columns):
        self.batches.append(len(completions))
        if "boom" in completions:
            raise RuntimeError("model failure")
        return torch.tensor([float(len(c)) for c in completions]) * self.scale * torch.tensor(columns["w"])


def test_model_reward_batches_and_isolates_failures():
    reward = FlakyReward()
    texts = ["a", "bb", "boom", "dddd", "eeeee", "ffffff", "g"]
    scores = reward(texts, w=[1.0, 1.0, 1.0, 2.0, 1.0, 1.0, 1.0])
    assert scores == [1.0, 2.0, 0.0, 8.0, 5.0, 6.0, 1.0]
    assert reward.batches == [3, 1, 1, 1, 3, 1]  # the failing batch is retried row by row
    assert reward.scale.grad is None


def test_clip_style_reward_is_the_cosine_of_the_embeddings():
    torch.manual_seed(0)
    image_encoder = nn.Sequential(nn.Flatten(), nn.Linear(64, 8))
    vocab = {f"<c{d}>": d for d in range(10)}
    text_encoder = nn.Embedding(10, 8)
    reward = ClipStyleImageReward(image_encoder, text_encoder, batch_size=2,
                                  tokenize_text=lambda texts: torch.tensor([vocab[t] for t in texts]))
    images = [encode_image([(i * 7 + k) % 17 for i in range(64)]) for k in range(3)]
    texts = images + ["bad length", "z" * 64]
    prompts = ["<c1>", "<c2>", "<c3>", "<c1>", "<c1>"]
    scores = reward(texts, prompt=prompts)
    with torch.no_grad():
        for k in range(3):
            pixels = torch.tensor([ord(c) - ord("a") for c in images[k]], dtype=torch.float32).view(1, 8, 8) / 16
            expected = torch.cosine_similarity(image_encoder(pixels), text_encoder(torch.tensor([k + 1])), dim=-1)
            assert scores[k] == pytest.approx(expected.item(), abs=1e-5)
    assert scores[3:] == [0.0, 0.0] and all(-1.0 <= s <= 1.0 for s in scores)
    assert reward(images[:1], prompt=["<c9>"]) != pytest.approx(scores[:1])  # the text matters
    assert reward(images[:1]) == [0.0]  # no prompt column: scored as an error, not raised
