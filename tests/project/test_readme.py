"""The README gets a new user to a real model, with a set-up that is correct anywhere: its set-up
commands are what CI runs."""

import re

from support.common import ROOT


def test_readme_setup_is_what_ci_runs_and_names_the_cpu_wheel_index():
    readme = (ROOT / "README.md").read_text()
    setup = re.search(r"## Set up and test\n\n```bash\n(.*?)```", readme, re.S).group(1).strip().splitlines()
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line and not line.startswith(("#", "set ", "cd "))]
    assert ci[:len(setup)] == setup  # then only checks the README names (the aarch64 check)
    assert all(line.split()[0] in readme for line in ci[len(setup):])
    assert "--index-url https://download.pytorch.org/whl/cpu" in next(s for s in setup if "pip install" in s)
    first_screen = readme[:readme.index("## Set up and test")]
    for words in ("tencent/Youtu-VL-4B-Instruct", "tencent/Youtu-LLM-2B", "hf download", "edgevl convert",
                  "edgevl run"):
        assert words in first_screen, words
