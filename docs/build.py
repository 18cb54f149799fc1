"""Build fedtrust's API documentation from its docstrings (pdoc): ``python docs/build.py [OUT]``.

``make docs`` writes it to docs/api (open docs/api/index.html); the test suite builds it into a
temporary folder and checks that every public module has its page and pdoc raised no warning.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

#: The public modules: the package and every subpackage or module a user imports from.
MODULES = [
    "fedtrust", "fedtrust.aggregators", "fedtrust.attacks", "fedtrust.data", "fedtrust.flower",
    "fedtrust.inference", "fedtrust.models", "fedtrust.probabilistic", "fedtrust.report", "fedtrust.sim",
    "fedtrust.sweeps", "fedtrust.checkpoint", "fedtrust.server", "fedtrust.rules", "fedtrust.registry",
]  # fmt: skip
#: Warnings pdoc raises that say nothing wrong about the docs: Info's key "lambda" (a Python keyword,
#: declared through TypedDict's functional form) has no source line pdoc can find.
EXPECTED = ("fedtrust.aggregators.Info.lambda",)


def build(out: Path) -> list[str]:
    """Write the HTML under ``out``; the unexpected warnings pdoc raised, as text."""
    import pdoc

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pdoc.pdoc(*MODULES, output_directory=Path(out))
    from_pdoc = [w for w in caught if f"{Path(pdoc.__file__).parent}" in w.filename]  # not imports' own
    return [str(w.message) for w in from_pdoc if not any(e in str(w.message) for e in EXPECTED)]


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "api")
    problems = build(out)
    for problem in problems:
        print(f"warning: {problem}", file=sys.stderr)
    print(f"wrote {out / 'index.html'}")
    sys.exit(1 if problems else 0)
