"""A small agent task through E2B's own packages only (`e2b`, `e2b-code-interpreter`), no
Sandlot import, against `sandlot up` (docs/e2b.md, "Code interpreter").

    export E2B_API_URL=http://127.0.0.1:7070 E2B_SANDBOX_URL=http://127.0.0.1:7070
    export E2B_API_KEY=e2b_sandlot_no_auth   # or a Sandlot key
    python examples/e2b_code_interpreter_agent.py
"""
from e2b_code_interpreter import Sandbox

# template code-interpreter-v1 -> Sandlot's lang-python image. `timeout` (seconds) is the
# sandbox's TTL: without it E2B's API default, 15 s, applies (the SDK sends none), too short
# for this script on a microvm under TCG.
with Sandbox.create(timeout=120) as sbx:
    print("sandbox", sbx.sandbox_id)
    sbx.files.write("/home/user/data.csv", "x,y\n1,2\n2,4\n3,9\n")
    sbx.run_code("import pandas as pd\ndf = pd.read_csv('data.csv')",
                 on_stdout=lambda m: print("stdout:", m.line, end=""))
    print("rows (state kept between calls):", sbx.run_code("len(df)").text)
    sbx.run_code("print('sum of y:', df.y.sum())",
                 on_stdout=lambda m: print("stdout:", m.line, end=""))
    e = sbx.run_code("1 / len(df[df.y > 100])  # no row matches: ZeroDivisionError")
    print("error:", e.error.name, e.error.value)
    e = sbx.run_code("import matplotlib.pyplot as plt\nplt.plot(df.x, df.y)\nplt.show()")
    pngs = [r.png for r in e.results if r.png]
    print("figure: png of", len(pngs[0]) if pngs else 0, "base64 characters")
    print("command:", sbx.commands.run("ls /home/user").stdout.strip())
