//! The `run_code` language table: one [`Language`] row per SandboxFusion language mode,
//! read by the one generic executor in [`super`]. Adding a language is a row here plus a
//! toolchain image (`sandlot image build lang-<x>`), not a new code path.
//!
//! Argv entries may hold placeholders, replaced per call: `{file}` (the source file name,
//! e.g. `main.rs`) and `{class}` (the Java public class / Scala object name the source
//! declares, `Main` when none). Commands run in `/workspace` as the sandbox's root with the
//! image's environment plus the row's `env`. Compile and run argv follow SandboxFusion's
//! runners (`sandbox/runners/major.py`, `minor.py`); where Debian 12 ships another tool
//! (mono's `mcs` for `dotnet`, `gdc` for `dmd`, `kotlinc -script` for `kotlin`) the row
//! says so.

/// How a mode decides `Success`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Layout {
    /// A program: `Success` when compile (if any) and run exit 0 within their limits.
    Program,
    /// A test file run by the mode's test runner (pytest, go test, JUnit console, jest,
    /// gtest, D `unittest` blocks): `Success` when every test passes, i.e. the runner exits
    /// 0; one failing test → `Failed`.
    Tests,
}

/// Where `{class}` comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClassFrom {
    /// No `{class}` in the row.
    None,
    /// The first `public class X` (Java; SandboxFusion's `find_java_public_class_name`).
    JavaPublicClass,
    /// The first `object X` (Scala; SandboxFusion's `find_scala_classname`).
    ScalaObject,
}

/// One language mode.
#[derive(Debug, Clone, Copy)]
pub struct Language {
    /// Mode name as SandboxFusion spells it (`python`, `go_test`, `R`, `D_ut`, ...).
    pub name: &'static str,
    /// Other accepted names.
    pub aliases: &'static [&'static str],
    /// Toolchain image (toolchains contract: `lang-<x>`).
    pub image: &'static str,
    /// Image used when `image` is not installed (the base `python` image already has
    /// python3, g++ and bash); `None` → a missing `image` is a `SandboxError`.
    pub fallback_image: Option<&'static str>,
    /// Source file the code is written to, in `/workspace` (may use `{class}`).
    pub file: &'static str,
    /// Compile argv (`compile_timeout` applies), or `None` for interpreted modes.
    pub compile: Option<&'static [&'static str]>,
    /// Run argv (`run_timeout` and `stdin` apply).
    pub run: &'static [&'static str],
    /// Extra environment for compile and run (over the image's).
    pub env: &'static [(&'static str, &'static str)],
    /// How `Success` is decided.
    pub layout: Layout,
    /// Where `{class}` comes from.
    pub class_from: ClassFrom,
    /// Memory limit in MiB when the request gives none (`memory_limit_MB` ≤ 0).
    pub memory_mib: u64,
    /// Prepend `<?php` when the code lacks a PHP open tag (SandboxFusion's
    /// `ensure_php_tag_in_string`).
    pub php_tag: bool,
    /// Text put before the code in its source file (C#'s implicit `using`s of a `dotnet
    /// new console` project), on one line so the code's line numbers move by one.
    pub prelude: &'static str,
    /// Files written before the compile: `(absolute path, contents)` (C#'s entry point
    /// with .NET's assert behaviour). Outside `/workspace`, so a program listing its
    /// working directory sees only its own files.
    pub support: &'static [(&'static str, &'static str)],
}

const fn row(name: &'static str, image: &'static str, file: &'static str) -> Language {
    Language {
        name,
        aliases: &[],
        image,
        fallback_image: None,
        file,
        compile: None,
        run: &[],
        env: &[],
        layout: Layout::Program,
        class_from: ClassFrom::None,
        memory_mib: 512,
        php_tag: false,
        prelude: "",
        support: &[],
    }
}

/// Go without a module, caches in the sandbox's writable `/tmp`; packages resolve from
/// Debian's Go source packages in `/usr/share/gocode` (testify, logrus, zap, yaml, ... of
/// SandboxFusion's `runtime/go/go.mod` that Debian 12 ships; `lang-go` installs them).
const GO_ENV: &[(&str, &str)] = &[
    ("GO111MODULE", "off"),
    ("GOCACHE", "/tmp/.gocache"),
    ("GOPATH", "/tmp/go:/usr/share/gocode"),
    ("HOME", "/tmp"),
];
const HOME_TMP_NO_COLOR: &[(&str, &str)] = &[("HOME", "/tmp"), ("FORCE_COLOR", "0")];

/// Java's class path: the working directory and javatuples (SandboxFusion's
/// `runtime/java/javatuples-1.2.jar`; Debian's `libjavatuples-java` in `lang-java`).
const JAVA_CP: &str = ".:/usr/share/java/javatuples.jar";

/// Jest's inline config. SandboxFusion's jest runs in a project whose `babel.config.js`
/// has `@babel/preset-env` (node current) and `@babel/preset-typescript`, so test files
/// are TypeScript; here babel-jest (jest's own) gets those presets inline, from Debian's
/// `node-babel7` (in `lang-node` through npm's dependencies). An inline config also because
/// jest refuses a root without `package.json` or `jest.config.*`.
const JEST_CONFIG: &str = r#"{"rootDir":"/workspace","cacheDirectory":"/tmp/.jest","transform":{"\\.[jt]sx?$":["/opt/sandlot/node/lib/node_modules/jest/node_modules/babel-jest",{"presets":[["/usr/share/nodejs/@babel/preset-env",{"targets":{"node":"current"}}],"/usr/share/nodejs/@babel/preset-typescript"]}]}}"#;

/// C#: the implicit `using`s of .NET 6+'s console template (SandboxFusion builds with
/// `dotnet new console`, so programs may call `Console` without `using System;`).
const CSHARP_PRELUDE: &str = "using System; using System.IO; using System.Collections.Generic; using System.Linq; using System.Net.Http; using System.Threading; using System.Threading.Tasks;\n";
/// Where the C# entry point goes in the sandbox.
const CSHARP_ENTRY: &str = "/opt/sandlot/run_code/SandlotEntry.cs";
const HOME_TMP: &[(&str, &str)] = &[("HOME", "/tmp")];

/// Every language mode, in SandboxFusion's order.
pub static LANGUAGES: &[Language] = &[
    Language {
        aliases: &["python3"],
        fallback_image: Some("python"),
        run: &["python3", "{file}"],
        ..row("python", "lang-python", "main.py")
    },
    Language {
        // No fallback: the base `python` image has no pytest.
        run: &["python3", "-m", "pytest", "-q", "-p", "no:cacheprovider", "{file}"],
        layout: Layout::Tests,
        ..row("pytest", "lang-python", "test_main.py")
    },
    Language {
        fallback_image: Some("python"),
        compile: Some(&["g++", "-O2", "-std=c++17", "-o", "test", "{file}", "-lpthread"]),
        run: &["./test"],
        ..row("cpp", "lang-cpp", "main.cpp")
    },
    Language {
        compile: Some(&[
            "g++", "-std=c++17", "-o", "test", "{file}", "-lgtest", "-lgtest_main", "-pthread",
        ]),
        run: &["./test"],
        layout: Layout::Tests,
        ..row("gtest", "lang-cpp", "main.cpp")
    },
    Language {
        aliases: &["js", "javascript"],
        run: &["node", "{file}"],
        ..row("nodejs", "lang-node", "main.js")
    },
    Language {
        aliases: &["ts"],
        run: &["tsx", "{file}"],
        env: HOME_TMP,
        ..row("typescript", "lang-node", "main.ts")
    },
    Language {
        run: &["jest", "--ci", "--config", JEST_CONFIG],
        env: HOME_TMP_NO_COLOR,
        layout: Layout::Tests,
        memory_mib: 1024,
        ..row("jest", "lang-node", "main.test.ts")
    },
    Language {
        compile: Some(&["go", "build", "-o", "out", "{file}"]),
        run: &["./out"],
        env: GO_ENV,
        memory_mib: 1024,
        ..row("go", "lang-go", "main.go")
    },
    Language {
        run: &["go", "test", "{file}"],
        env: GO_ENV,
        layout: Layout::Tests,
        memory_mib: 1024,
        ..row("go_test", "lang-go", "main_test.go")
    },
    Language {
        compile: Some(&["javac", "-cp", JAVA_CP, "{file}"]),
        run: &["java", "-cp", JAVA_CP, "-ea", "Main"],
        memory_mib: 1024,
        ..row("java", "lang-java", "Main.java")
    },
    Language {
        compile: Some(&[
            "sh",
            "-c",
            "exec javac -cp \".:/usr/share/java/javatuples.jar:$SANDLOT_JUNIT_JAR\" *.java",
        ]),
        run: &[
            "sh",
            "-c",
            "exec java -jar \"$SANDLOT_JUNIT_JAR\" --class-path .:/usr/share/java/javatuples.jar --scan-class-path --disable-banner",
        ],
        layout: Layout::Tests,
        class_from: ClassFrom::JavaPublicClass,
        memory_mib: 1024,
        ..row("junit", "lang-java", "{class}.java")
    },
    Language {
        compile: Some(&["rustc", "-o", "test", "{file}"]),
        run: &["./test"],
        memory_mib: 1024,
        ..row("rust", "lang-rust", "main.rs")
    },
    Language {
        fallback_image: Some("python"),
        run: &["bash", "{file}"],
        ..row("bash", "lang-python", "main.sh")
    },
    Language {
        run: &["php", "-f", "{file}"],
        php_tag: true,
        ..row("php", "lang-php", "main.php")
    },
    Language {
        run: &["ruby", "{file}"],
        ..row("ruby", "lang-ruby", "main.rb")
    },
    Language {
        run: &["lua", "{file}"],
        ..row("lua", "lang-lua", "main.lua")
    },
    Language {
        fallback_image: Some("python"),
        run: &["perl", "{file}"],
        ..row("perl", "lang-perl", "main.pl")
    },
    Language {
        aliases: &["r"],
        run: &["Rscript", "{file}"],
        ..row("R", "lang-r", "main.R")
    },
    Language {
        aliases: &["cs", "c#"],
        // DEBUG and TRACE as `dotnet run`'s Debug build, so Debug.Assert is compiled in;
        // the entry point wraps the program's Main (see csharp_entry.cs); CS0105: the
        // prelude's `using`s repeat the program's.
        compile: Some(&[
            "mcs",
            "-d:DEBUG",
            "-d:TRACE",
            "-nowarn:105",
            "-r:System.Net.Http.dll",
            "-main:SandlotEntry",
            "-out:main.exe",
            "{file}",
            CSHARP_ENTRY,
        ]),
        run: &["mono", "main.exe"],
        prelude: CSHARP_PRELUDE,
        support: &[(CSHARP_ENTRY, include_str!("csharp_entry.cs"))],
        ..row("csharp", "lang-csharp", "main.cs")
    },
    Language {
        compile: Some(&["scalac", "{file}"]),
        run: &["scala", "{class}"],
        class_from: ClassFrom::ScalaObject,
        memory_mib: 1024,
        ..row("scala", "lang-scala", "main.scala")
    },
    Language {
        aliases: &["kotlin"],
        run: &["kotlinc", "-script", "{file}"],
        env: HOME_TMP,
        memory_mib: 1024,
        ..row("kotlin_script", "lang-kotlin", "main.kts")
    },
    Language {
        compile: Some(&["gdc", "-funittest", "-o", "test", "{file}"]),
        run: &["./test"],
        layout: Layout::Tests,
        ..row("D_ut", "lang-d", "main.d")
    },
    Language {
        run: &["racket", "{file}"],
        env: HOME_TMP,
        ..row("racket", "lang-racket", "main.rkt")
    },
    Language {
        compile: Some(&[
            "iverilog", "-Wall", "-Winfloop", "-Wno-timescale", "-g2012", "-s", "tb", "-o",
            "test.vvp", "{file}",
        ]),
        run: &["vvp", "-n", "test.vvp"],
        ..row("verilog", "lang-verilog", "main.sv")
    },
    Language {
        run: &["sqlite3", "-bail", ":memory:", ".read {file}"],
        ..row("sql", "lang-sql", "main.sql")
    },
];

/// The row of `name` (a mode name or an alias), or `None`.
pub fn find(name: &str) -> Option<&'static Language> {
    LANGUAGES
        .iter()
        .find(|l| l.name == name || l.aliases.contains(&name))
}

/// Every mode name, for error messages.
pub fn names() -> Vec<&'static str> {
    LANGUAGES.iter().map(|l| l.name).collect()
}

/// The identifier after the first `keyword` token in `code` that `pred(line)` accepts.
fn ident_after(code: &str, keyword: &str, line_ok: impl Fn(&str) -> bool) -> Option<String> {
    for line in code.lines().filter(|l| line_ok(l)) {
        let mut words = line
            .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == '$'))
            .filter(|w| !w.is_empty());
        while let Some(w) = words.next() {
            if w == keyword {
                return words.next().map(str::to_owned);
            }
        }
    }
    None
}

impl Language {
    /// The `{class}` value for `code` (`Main` when the code declares none).
    pub fn class_name(&self, code: &str) -> String {
        let found = match self.class_from {
            ClassFrom::None => None,
            ClassFrom::JavaPublicClass => ident_after(code, "class", |l| {
                l.split_whitespace().any(|w| w == "public")
            }),
            ClassFrom::ScalaObject => ident_after(code, "object", |_| true),
        };
        found.unwrap_or_else(|| "Main".into())
    }

    /// The source file name for `code`.
    pub fn file_name(&self, code: &str) -> String {
        self.file.replace("{class}", &self.class_name(code))
    }

    /// `argv` with `{file}` and `{class}` replaced for `code`.
    pub fn expand(&self, argv: &[&str], code: &str) -> Vec<String> {
        let file = self.file_name(code);
        let class = self.class_name(code);
        argv.iter()
            .map(|a| a.replace("{file}", &file).replace("{class}", &class))
            .collect()
    }

    /// The source as written: the row's prelude, then the code; PHP gets `<?php` when it
    /// has no open tag.
    pub fn source(&self, code: &str) -> String {
        if self.php_tag && !code.contains("<?php") && !code.contains("<?=") {
            format!("<?php\n{code}")
        } else {
            format!("{}{code}", self.prelude)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_mode_and_alias_is_unique() {
        let mut seen = std::collections::BTreeSet::new();
        for l in LANGUAGES {
            for n in std::iter::once(&l.name).chain(l.aliases) {
                assert!(seen.insert(*n), "{n} twice");
            }
            assert!(!l.run.is_empty(), "{} has no run argv", l.name);
        }
        assert_eq!(LANGUAGES.len(), 25);
    }

    #[test]
    fn class_names_as_sandboxfusion() {
        let junit = find("junit").unwrap();
        let code = "import x;\npublic class FooTest {\n @Test void t() {}\n}\nclass Other {}";
        assert_eq!(junit.file_name(code), "FooTest.java");
        assert_eq!(junit.file_name("class A {}"), "Main.java");
        let scala = find("scala").unwrap();
        assert_eq!(
            scala.expand(scala.run, "object Hello extends App {}"),
            vec!["scala", "Hello"]
        );
        assert_eq!(find("php").unwrap().source("echo 1;"), "<?php\necho 1;");
        assert_eq!(
            find("php").unwrap().source("<?php echo 1;"),
            "<?php echo 1;"
        );
        assert_eq!(find("python3").unwrap().name, "python");
        assert!(find("cobol").is_none());
    }

    #[test]
    fn csharp_gets_implicit_usings_and_its_entry_point() {
        let cs = find("csharp").unwrap();
        let src = cs.source("class P { static void Main() {} }");
        let (first, rest) = src.split_once('\n').unwrap();
        assert!(first.starts_with("using System;"), "{first}");
        assert_eq!(rest, "class P { static void Main() {} }");
        let compile = cs.expand(cs.compile.unwrap(), "");
        assert!(compile.contains(&"-d:DEBUG".to_string()));
        assert!(compile.contains(&"-main:SandlotEntry".to_string()));
        // The entry file is compiled, written where the compile looks for it.
        let (path, text) = cs.support[0];
        assert!(compile.iter().any(|a| a == path));
        assert!(text.contains("class SandlotEntry") && text.contains("Environment.Exit(134)"));
        // Rows without a prelude write the code as is.
        assert_eq!(find("python").unwrap().source("print(1)"), "print(1)");
    }

    #[test]
    fn jest_config_is_json_with_a_typescript_transform() {
        let jest = find("jest").unwrap();
        let cfg: serde_json::Value = serde_json::from_str(jest.run[3]).unwrap();
        let t = &cfg["transform"]["\\.[jt]sx?$"];
        assert!(t[0].as_str().unwrap().ends_with("/babel-jest"));
        assert!(t[1]["presets"][1]
            .as_str()
            .unwrap()
            .ends_with("@babel/preset-typescript"));
    }
}
