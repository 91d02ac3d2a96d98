"""What every process reads the same way: sizes on the command line and the name a model is served under."""

import pytest

from shared.config import parse_size, served_model_name


def test_served_model_name():
    assert served_model_name("default") == "SmolLM2-135M-Instruct"
    assert served_model_name("/models/Llama-3-8B/") == "Llama-3-8B"
    assert served_model_name("/m/x.Q4_1.gguf") == "x.Q4_1.gguf"


@pytest.mark.parametrize("text, size", [("1048576", 1 << 20), ("1.5GiB", 3 << 29), ("800M", 800 << 20),
                                        (" 2 kb ", 2048), (4096, 4096)])
def test_sizes_read_with_binary_units(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "12 parsecs", "1.5.2G"])
def test_unreadable_sizes_say_what_was_expected(text):
    with pytest.raises(ValueError, match="expected a number"):
        parse_size(text)
