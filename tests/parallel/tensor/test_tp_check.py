"""check_tp: one-line ConfigErrors for shapes that do not split over the tensor-parallel ranks (no torch needed)."""

from __future__ import annotations

import pytest

from foldtrain.errors import ConfigError
from foldtrain.parallel.tensor import check_tp


@pytest.mark.parametrize(
    "n_head,d_model,vocab,tp",
    [(12, 768, 50304, 1), (12, 768, 50304, 2), (12, 768, 50304, 4), (4, 32, 64, 2), (3, 33, 7, 1), (8, 64, 512, 8)],
)
def test_valid_shapes_pass(n_head, d_model, vocab, tp):
    assert check_tp(n_head, d_model, vocab, tp) is None


def _error(*args) -> str:
    with pytest.raises(ConfigError) as e:
        check_tp(*args)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_heads_not_divisible():
    msg = _error(12, 768, 50304, 8)
    assert "--model.n_head 12" in msg and "--parallel.tp 8" in msg and "whole attention heads" in msg


def test_d_model_not_divisible():
    msg = _error(2, 5, 64, 2)  # heads split, width does not (a config that validate() would refuse anyway)
    assert "--model.d_model 5" in msg and "--parallel.tp 2" in msg and "multiple of tp" in msg


def test_an_unpadded_embedding_is_an_error_a_configured_vocabulary_is_not():
    msg = _error(4, 32, 8191, 2)  # a model built by hand, without GPTShape.from_config's padding
    assert msg.startswith("the embedding's 8191 rows are not divisible by --parallel.tp 2;") and "pads them" in msg
    assert check_tp(4, 32, None, 2) is None  # a configured model: its vocabulary is padded


def test_bad_tp():
    msg = _error(4, 32, 64, 0)
    assert "--parallel.tp" in msg and ">= 1" in msg


def test_heads_checked_before_width():
    # both fail: the message names the first problem only
    msg = _error(3, 30, 64, 4)
    assert "n_head" in msg and "d_model 30" not in msg
