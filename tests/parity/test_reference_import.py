import pytest

from tests.parity.conftest import reference


def test_missing_reference_library_skips_unless_parity_is_required(monkeypatch):
    monkeypatch.delenv("MMRL_REQUIRE_PARITY", raising=False)
    with pytest.raises(pytest.skip.Exception, match="parity extra"):
        reference("verl_not_installed.core_algos")
    monkeypatch.setenv("MMRL_REQUIRE_PARITY", "1")
    with pytest.raises(pytest.fail.Exception, match="MMRL_REQUIRE_PARITY=1"):
        reference("verl_not_installed.core_algos")
