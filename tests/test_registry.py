"""The registry helper behind the arms, geometries, checks and labs (creditlab.core.registry)."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Mapping
from typing import NamedTuple

import pytest

from creditlab.core.registry import Registry
from creditlab.errors import ConfigError


def _one():
    return 1


def _two():
    return 2


class _Record(NamedTuple):
    title: str
    fn: object


def test_register_keeps_insertion_order_and_reads_as_a_mapping():
    reg = Registry("thing")
    assert reg.register("b", _one) is _one and reg.register("a", _two) is _two
    assert isinstance(reg, Mapping) and list(reg) == ["b", "a"] and len(reg) == 2
    assert reg["a"] is _two and reg.get("b") is _one and dict(reg.items()) == {"b": _one, "a": _two}
    assert "a" in reg and "c" not in reg and 3 not in reg and ", ".join(reg) == "b, a"
    assert reg.family == "thing" and "b, a" in repr(reg)
    with pytest.raises(KeyError):
        reg["c"]
    with pytest.raises(TypeError):
        reg["c"] = _one  # read-only: only register / unregister change it


def test_registering_the_same_object_again_is_a_no_op():
    reg = Registry("thing")
    reg.register("one", _one)
    assert reg.register("one", _one) is _one and list(reg) == ["one"]


def test_another_object_under_a_taken_name_names_where_it_is_registered():
    reg = Registry("thing")
    reg.register("one", _one)
    with pytest.raises(ConfigError, match=f"^thing: 'one' is already registered to {__name__}._one$") as e:
        reg.register("one", _two)
    assert e.value.parameter == "thing" and reg["one"] is _one
    reg.register("sqrt", math.sqrt)
    with pytest.raises(ConfigError, match="'sqrt' is already registered to math.sqrt"):
        reg.register("sqrt", math.floor)
    reg.register("record", _Record("r", _one))
    with pytest.raises(ConfigError, match=f"'record' is already registered to {__name__}._Record"):
        reg.register("record", _Record("r", _one))  # an equal but distinct instance: named by its class


def test_an_unknown_name_lists_every_registered_name():
    reg = Registry("thing")
    with pytest.raises(ConfigError, match=r"^thing: unknown 'x'; valid: $"):
        reg.get("x")
    reg.register("one", _one)
    reg.register("two", _two)
    with pytest.raises(ConfigError, match=r"^thing: unknown 'x'; valid: one, two$"):
        reg.get("x")
    with pytest.raises(ConfigError, match="unknown 3; valid: one, two"):
        reg.get(3)
    with pytest.raises(ConfigError, match=r"unknown \['x'\]"):
        reg.get(["x"])  # not hashable: still an unknown name
    assert reg.get("x", None) is None and reg.get("x", _two) is _two and reg.get("one", None) is _one


def test_unregister_returns_the_object_and_refuses_unknown_names():
    reg = Registry("thing")
    reg.register("one", _one)
    reg.register("two", _two)
    assert reg.unregister("one") is _one and list(reg) == ["two"]
    with pytest.raises(ConfigError, match="unknown 'one'; valid: two"):
        reg.unregister("one")
    reg.register("one", _two)  # the name is free again
    assert list(reg) == ["two", "one"]


def test_registered_removes_at_the_end_of_the_block_even_on_error():
    reg = Registry("thing")
    with reg.registered("one", _one) as fn:
        assert fn is _one and reg["one"] is _one
    assert "one" not in reg
    with pytest.raises(RuntimeError, match="boom"), reg.registered("one", _one):
        raise RuntimeError("boom")
    assert "one" not in reg
    reg.register("taken", _one)
    with pytest.raises(ConfigError, match="already registered"), reg.registered("taken", _two):
        pass  # pragma: no cover
    assert reg["taken"] is _one  # a refused registration leaves the holder in place
    with reg.registered("one", _one):
        reg.unregister("one")
        reg.register("one", _two)  # replaced inside the block: the replacement stays
    assert reg["one"] is _two


def test_key_compares_and_names_a_part_of_the_registered_objects():
    reg = Registry("check", key=lambda record: record.fn)
    first = _Record("first", _one)
    assert reg.register("c", first) is first
    assert reg.register("c", _Record("again", _one)) is first  # the same function: a no-op, the first stays
    with pytest.raises(ConfigError, match=f"'c' is already registered to {__name__}._one"):
        reg.register("c", _Record("other", _two))


def test_validate_runs_only_for_new_registrations_after_the_clash_check():
    seen = []

    def validate(obj):
        seen.append(obj)
        if obj is _two:
            raise ConfigError("thing", "two is not allowed")

    reg = Registry("thing", validate=validate)
    reg.register("one", _one)
    reg.register("one", _one)
    assert seen == [_one]
    with pytest.raises(ConfigError, match="already registered"):
        reg.register("one", _two)  # the clash is reported before validation
    with pytest.raises(ConfigError, match="two is not allowed"):
        reg.register("two", _two)
    assert list(reg) == ["one"]


def test_the_registries_of_creditlab_are_registries():
    from creditlab.core.correction import CORRECTIONS
    from creditlab.core.credit import GEOMETRIES
    from creditlab.diagnose import CHECKS

    assert all(isinstance(r, Registry) for r in (CORRECTIONS, GEOMETRIES, CHECKS))
    assert (CORRECTIONS.family, GEOMETRIES.family, CHECKS.family) == ("correction", "geometry", "check")


def test_register_check_treats_re_registration_as_the_other_registries_do():
    from creditlab.diagnose import CHECKS, register_check

    cid = next(iter(CHECKS))
    check = CHECKS[cid]
    deco = register_check(cid, title="again", needs=(), threshold=check.threshold, fix="")
    assert deco(check.fn) is check.fn and CHECKS[cid] is check  # the same function: a no-op
    with pytest.raises(ConfigError, match=f"check: '{cid}' is already registered to creditlab.diagnose.checks."):
        deco(_one)


def test_importing_the_registry_imports_no_tensor_library():
    code = "import sys, creditlab.core.registry; print(sorted({'torch', 'numpy'} & set(sys.modules)))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]", r.stdout
