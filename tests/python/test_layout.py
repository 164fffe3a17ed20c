"""docs/design.md's layout table matches the tree: every folder it names exists, every source
folder is in it, and every file a csrc/ row names exists in that folder."""
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SKIP_TOP = {"build", "dist", "shared"}


def ignored_top_folders():
    """Top-level folders .gitignore names ("results/", "/.tools/"): what the scripts write (the
    main job's results/ab, say) is not source, and a run of it must not fail this test."""
    path = os.path.join(ROOT, ".gitignore")
    if not os.path.exists(path):
        return set()
    lines = open(path, encoding="utf-8").read().split()
    return {ln.strip("/") for ln in lines
            if ln.endswith("/") and "/" not in ln.strip("/") and not any(c in ln for c in "*?[")}


def layout_rows():
    text = open(os.path.join(ROOT, "docs", "design.md"), encoding="utf-8").read()
    section = text.split("## Layout", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].startswith("`"):
            continue
        rows.append((re.findall(r"`([^`]+)`", cells[0]), cells[1]))
    return rows


def folders_named(rows):
    """The folders the first column names ("{cpu,cuda}/" expands under the folder before it)."""
    out = []
    for paths, _ in rows:
        previous = None
        for p in paths:
            if p.startswith("{"):
                out += [os.path.join(previous, part) + "/" for part in p.strip("{}/").split(",")]
                continue
            out.append(p)
            previous = p
    return out


def test_every_folder_the_table_names_exists():
    missing = [p for p in folders_named(layout_rows()) if not os.path.exists(os.path.join(ROOT, p))]
    assert not missing, f"design.md's layout names paths that do not exist: {missing}"


def test_every_source_folder_is_in_the_table():
    named = {p.rstrip("/") for p in folders_named(layout_rows())}
    folders = []
    for base in ("csrc", "python"):
        for d, subdirs, _ in os.walk(os.path.join(ROOT, base)):
            subdirs[:] = [s for s in subdirs if not s.startswith(("__", ".")) and s != "build"]
            rel = os.path.relpath(d, ROOT)
            if rel != base and rel.count(os.sep) <= 3:
                folders.append(rel)
    skipped = SKIP_TOP | ignored_top_folders()
    tops = [e for e in os.listdir(ROOT) if os.path.isdir(os.path.join(ROOT, e))
            and not e.startswith(".") and not e.startswith("build") and e not in skipped]
    uncovered = [f for f in folders + tops
                 if f not in named and not any(f.startswith(n + "/") for n in named)
                 and not any(n.startswith(f + "/") for n in named)]
    assert not uncovered, f"folders missing from design.md's layout: {uncovered}"


def test_every_file_a_csrc_row_names_is_in_its_folder():
    missing = []
    for paths, what in layout_rows():
        folder = paths[0]
        if not folder.startswith("csrc/"):
            continue
        for name in re.findall(r"`([A-Za-z_]+\.(?:cpp|h|cu|\*|\{h,cpp\}))`", what):
            pattern = name.replace("{h,cpp}", "*")
            if not glob.glob(os.path.join(ROOT, folder, "**", pattern), recursive=True):
                missing.append(folder + name)
    assert not missing, f"design.md's layout names files that are not there: {missing}"


def test_tests_import_without_sys_path_edits_and_are_named_by_unit():
    """Tests load what they test like any package (common_utils.load_script for scripts), and a
    test file is named after its unit, not "extra"/"misc"."""
    edits, vague = [], []
    pattern = re.compile(r"sys\.path\.(insert|append|extend)\(|sys\.path\[[^\]]*\]\s*=")
    for path in glob.glob(os.path.join(ROOT, "tests", "python", "*.py")):
        name = os.path.basename(path)
        if re.search(r"(extra|misc|more)\b", name.replace("_", " ")):
            vague.append(name)
        with open(path, encoding="utf-8") as f:
            edits += [f"{name}:{i}" for i, line in enumerate(f, 1) if pattern.search(line)]
    assert not edits, f"sys.path edits in tests: {edits}"
    assert not vague, f"test files not named by unit: {vague}"
