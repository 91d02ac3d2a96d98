"""The GGUF reader (engine/model/gguf_file.py) against gguf's own GGUFReader, the oracle: the same metadata
values and the same tensor views, for files gguf's GGUFWriter writes in either byte order and for the default
model."""

import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf")

from services.executor.engine.model.gguf_file import read_gguf  # noqa: E402
from services.executor.engine.model.loader import default_model_path  # noqa: E402

V = gguf.GGUFValueType
INTS = {V.UINT8: (0, 255), V.INT8: (-128, 127), V.UINT16: (0, 65535), V.INT16: (-32768, 32767),
        V.UINT32: (0, 2**32 - 1), V.INT32: (-2**31, 2**31 - 1), V.UINT64: (0, 2**64 - 1), V.INT64: (-2**63, 2**63 - 1)}
FLOAT32 = st.floats(width=32, allow_nan=False)
TEXT = st.text(max_size=12)


def scalar(kind):
    if kind in INTS:
        return st.integers(*INTS[kind])
    return {V.FLOAT32: FLOAT32, V.FLOAT64: st.floats(allow_nan=False), V.BOOL: st.booleans(), V.STRING: TEXT}[kind]


SCALAR_KINDS = [*INTS, V.FLOAT32, V.FLOAT64, V.BOOL, V.STRING]
values = st.sampled_from(SCALAR_KINDS).flatmap(lambda kind: st.one_of(
    scalar(kind).map(lambda value: (kind, None, value)),
    st.lists(scalar(kind), min_size=1, max_size=6).map(lambda items: (V.ARRAY, kind, items))))  # gguf writes none empty
tensors = st.lists(st.tuples(st.sampled_from(["F32", "F16", "I32", "Q8_0"]),
                             st.lists(st.integers(1, 3), min_size=1, max_size=3)), max_size=4)


def write(path, metadata, specs, endian):
    w = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    for key, (kind, item, value) in metadata.items():
        w.add_key_value(key, value, kind, sub_type=item)
    rng = np.random.default_rng(0)
    for i, (kind, dims) in enumerate(specs):
        if kind == "Q8_0":  # rows of whole blocks, quantized by gguf itself
            data = gguf.quants.quantize(rng.standard_normal((*dims, 32)).astype(np.float32),
                                        gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(f"t{i}", data, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            dtype = {"F32": np.float32, "F16": np.float16, "I32": np.int32}[kind]
            w.add_tensor(f"t{i}", (rng.standard_normal(dims) * 100).astype(dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def assert_reads_as_gguf_does(path):
    ours, theirs = read_gguf(str(path)), gguf.GGUFReader(str(path))
    assert ours.metadata == {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert (mine.tensor_type, mine.shape) == (t.tensor_type, tuple(int(d) for d in t.shape))
        assert (mine.data.dtype, mine.data.shape) == (t.data.dtype, t.data.shape)
        assert np.array_equal(mine.data, t.data)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(metadata=st.dictionaries(st.text("abcdefgh.", min_size=1, max_size=10), values, max_size=6),
       specs=tensors, big=st.booleans())
def test_any_file_gguf_writes_reads_as_gguf_reads_it(tmp_path_factory, metadata, specs, big):
    path = tmp_path_factory.mktemp("gguf") / "any.gguf"
    metadata.pop("general.architecture", None)
    write(path, metadata, specs, gguf.GGUFEndian.BIG if big else gguf.GGUFEndian.LITTLE)
    assert_reads_as_gguf_does(path)


@pytest.mark.slow
def test_the_default_model_reads_as_gguf_reads_it():
    assert_reads_as_gguf_does(default_model_path())


@pytest.mark.parametrize("cut", [3, 20, 4096])
def test_a_cut_file_is_refused(tmp_path, cut):
    path = tmp_path / "whole.gguf"
    write(path, {"k": (V.ARRAY, V.STRING, ["a", "b"] * 500)}, [("F32", [64, 64])], gguf.GGUFEndian.LITTLE)
    (tmp_path / "cut.gguf").write_bytes(path.read_bytes()[:cut])
    with pytest.raises((ValueError, struct.error)):
        read_gguf(str(tmp_path / "cut.gguf"))
