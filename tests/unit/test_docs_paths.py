"""The docs and the code's docstrings point readers at files: every `folder/…/name.py` they name must be a file of the
tree (a move that leaves a pointer behind sends the next engineer to nothing)."""

import re
from pathlib import Path

from shared.config import PROJECT_ROOT

PATH = re.compile(r"\b((?:[A-Za-z_]\w*/)+)(\w+\.py)\b")
OUTSIDE = ("vllm/", "torch/", "transformers/", "triton/", "tests/")  # other projects' files, and tests' own


def dangling(root: Path, texts: list[Path]) -> list[str]:
    files = [str(p.relative_to(root)) for p in root.rglob("*.py") if ".venv" not in p.parts]
    found = []
    for text in texts:
        for match in PATH.finditer(text.read_text()):
            named = match.group(1) + match.group(2)
            if not named.startswith(OUTSIDE) and not any(f == named or f.endswith("/" + named) for f in files):
                found.append(f"{text.relative_to(root)}: {named}")
    return sorted(set(found))


def test_every_file_the_docs_and_docstrings_name_exists(tmp_path):
    texts = [*PROJECT_ROOT.glob("docs/*.md"), PROJECT_ROOT / "README.md",
             *(p for folder in ("services", "shared", "morphling_kernels")
               for p in (PROJECT_ROOT / folder).rglob("*.py"))]
    assert dangling(PROJECT_ROOT, texts) == []
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "here.py").write_text("")
    (tmp_path / "notes.md").write_text("see pkg/here.py and pkg/gone.py, and vllm/utils.py upstream")
    assert dangling(tmp_path, [tmp_path / "notes.md"]) == ["notes.md: pkg/gone.py"]
