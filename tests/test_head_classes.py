"""HeadClassMap: validation, JSON round trip, effective sink/window arrays."""

import json

import numpy as np
import pytest

from jaxkv.cache.head_classes import FORMAT, HeadClass, HeadClassMap, all_global, load_or_default

DOC_EXAMPLE = {"format": "jaxkv.head_classes/v1", "num_layers": 2, "num_kv_heads": 2,
               "heads": [[{"kind": "global"}, {"kind": "local", "sink": 64, "window": 256}],
                         [{"kind": "budget", "lower": 128, "upper": 1024}, {"kind": "retrieval"}]]}


def test_doc_example_roundtrip(tmp_path):
    path = tmp_path / "head_classes.json"
    path.write_text(json.dumps(DOC_EXAMPLE))
    hc = HeadClassMap.load(path)
    assert hc[0, 1] == HeadClass.local(64, 256) and hc[1, 0] == HeadClass.budget(128, 1024)
    assert hc.counts() == {"global": 1, "local": 1, "budget": 1, "retrieval": 1}
    out = tmp_path / "again.json"
    hc.save(out)
    assert json.loads(out.read_text()) == DOC_EXAMPLE
    assert HeadClassMap.load(out) == hc
    assert hc.kinds().tolist() == [["global", "local"], ["budget", "retrieval"]]


def test_all_global_and_default(tmp_path):
    hc = all_global(3, 2)
    assert hc.counts()["global"] == 6
    sink, window = hc.sink_window_arrays()
    assert sink.shape == window.shape == (3, 2) and sink.dtype == np.int32
    assert not sink.any() and not window.any()
    assert load_or_default(tmp_path, 3, 2) == hc
    (tmp_path / "head_classes.json").write_text(json.dumps(DOC_EXAMPLE))
    with pytest.raises(ValueError, match="layers"):
        load_or_default(tmp_path, 3, 2)
    assert load_or_default(tmp_path, 2, 2).counts()["local"] == 1


def test_sink_window_combination():
    g, loc = HeadClass.global_(), HeadClass.local(4, 100)
    hc = HeadClassMap(3, 2, ((g, loc), (g, loc), (HeadClass.retrieval(), HeadClass.local(0, 10))))
    sink, window = hc.sink_window_arrays((0, 50, 200))
    np.testing.assert_array_equal(window, [[0, 100], [50, 50], [200, 10]])
    np.testing.assert_array_equal(sink, [[0, 4], [0, 4], [0, 0]])
    with pytest.raises(ValueError, match="layer_windows"):
        hc.sink_window_arrays((0, 0))


@pytest.mark.parametrize("kw, match", [
    (dict(kind="lokal"), "unknown kind"),
    (dict(kind="local", sink=1, window=0), "window >= 1"),
    (dict(kind="local", sink=-1, window=3), "non-negative"),
    (dict(kind="budget", lower=5, upper=2), "lower <= upper"),
    (dict(kind="global", window=8), "does not apply"),
])
def test_head_class_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        HeadClass(**kw)


def _bad(**changes):
    obj = json.loads(json.dumps(DOC_EXAMPLE))
    obj.update(changes)
    return obj


@pytest.mark.parametrize("obj, match", [
    (_bad(format="jaxkv.head_classes/v0"), "format"),
    (_bad(num_layers=3), "3 lists"),
    (_bad(num_kv_heads=0), "positive integer"),
    (_bad(heads=[[{"kind": "global"}] * 2, [{"kind": "global"}]]), "2 entries"),
    (_bad(heads=[[{"kind": "global"}, {"kind": "local", "sink": 1}]] * 2), "missing"),
    (_bad(heads=[[{"kind": "global", "window": 3}, {"kind": "global"}]] * 2), "unexpected"),
    (_bad(heads=[[{"kind": "local", "sink": 1, "window": -4}, {"kind": "global"}]] * 2), "non-negative"),
    (_bad(heads=[[{"kind": "nope"}, {"kind": "global"}]] * 2), "unknown kind"),
    ([1, 2], "JSON object"),
])
def test_file_errors(tmp_path, obj, match):
    path = tmp_path / "h.json"
    path.write_text(json.dumps(obj))
    with pytest.raises(ValueError, match=match):
        HeadClassMap.load(path)


def test_invalid_json(tmp_path):
    path = tmp_path / "h.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        HeadClassMap.load(path)
    assert FORMAT == DOC_EXAMPLE["format"]


def test_map_shape_validation():
    with pytest.raises(ValueError, match="layers x"):
        HeadClassMap(2, 2, ((HeadClass(),) * 2,))
