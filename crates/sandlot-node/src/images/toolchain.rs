//! Toolchain images: `lang-<x>` = one layer per toolchain over the `python` image's base
//! layer (DSec's "base + dependencies" images), used by `run_code`'s language table.
//!
//! A toolchain layer is the overlayfs *upper* directory left by installing packages (Debian
//! bookworm with `apt-get`, PyPI with `pip`, npm with `npm install -g`) in a chroot whose
//! root is an overlay of its lower layers. Whiteouts and opaque directories are left in the
//! form overlayfs reads in a lower dir (Documentation/filesystems/overlayfs.rst), the same
//! form [`super::unpack`] writes for OCI layers, so every backend mounts a toolchain image as
//! it mounts a pulled one.
//!
//! Layers live in `<store>/layers/sha256/<hex>/` where `<hex>` is the SHA-256 of the layer's
//! recipe (toolchain name, package lists, the layers under it, and the base image's build
//! time): a layer whose recipe is unchanged is never built twice, two images that need the
//! same layer share one directory, and `sandlot image gc` collects layers no image names.
//! The base layer is the `python` image's own `rootfs`, referenced, never copied.
//!
//! The build keeps Debian's package lists and `.deb` files in `<cache>/apt-lists` and
//! `<cache>/apt-archives` (bind-mounted into the chroot, so they never land in a layer), and
//! pip's and npm's caches are not kept. The network is the host's (the chroot shares it).
use super::{
    fsync_dir, oci::LAYERS_DIR, tree_size, unmount_under, Image, ImageJson, ImageName, ImageSource,
    ImageStore, DEFAULT_PATH, ROOTFS_DIR,
};
use crate::{NodeError, NodeResult};
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use sha2::{Digest, Sha256};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

/// One toolchain: what its layer installs and what it sits on.
#[derive(Debug, Clone, Copy)]
pub struct Toolchain {
    /// Short name; the image is `lang-<name>`.
    pub name: &'static str,
    /// Debian bookworm packages (`apt-get install --no-install-recommends`).
    pub apt: &'static [&'static str],
    /// PyPI requirement specifiers (`pip install`, into the system python3).
    pub pip: &'static [&'static str],
    /// npm packages installed globally under `/opt/sandlot/node`.
    pub npm: &'static [&'static str],
    /// Toolchains whose layers sit under this one (e.g. `scala` on `java`).
    pub lower: &'static [&'static str],
    /// Extra environment of the image (`PATH` is always set).
    pub env: &'static [(&'static str, &'static str)],
    /// Paths (relative to the root) that must exist after the install.
    pub check: &'static [&'static str],
}

/// Where npm-installed tools go in `lang-node` (`bin/` is on the image's `PATH`).
pub const NODE_PREFIX: &str = "/opt/sandlot/node";

/// Every toolchain `sandlot image build lang-<name>` knows, in build order (a toolchain's
/// lowers come before it). SandboxFusion's python runtime set (its
/// `runtime/python/requirements.txt`) is cut down to what code datasets import and what
/// installs from wheels on python 3.11 without a GPU stack: torch, tensorflow, rdkit,
/// pyscf, PyQt5, opencv and the other multi-hundred-MiB packages are left out.
pub const TOOLCHAINS: &[Toolchain] = &[
    Toolchain {
        name: "python",
        apt: &["python3-pip"],
        pip: &[
            "numpy<2",
            "pandas",
            "scipy",
            "sympy",
            "networkx",
            "requests",
            "matplotlib",
            "seaborn",
            "scikit-learn",
            "statsmodels",
            "pillow",
            "beautifulsoup4",
            "lxml",
            "tabulate",
            "pydantic",
            "psutil",
            "toml",
            "jsonlines",
            "PyYAML",
            "pytest",
            "pytest-mock",
            "ipykernel",
            "jupyter_client",
            "nbformat",
        ],
        npm: &[],
        lower: &[],
        env: &[],
        check: &["usr/local/lib/python3.11/dist-packages/numpy"],
    },
    Toolchain {
        name: "cpp",
        apt: &["libgtest-dev"],
        pip: &[],
        npm: &[],
        lower: &[],
        env: &[],
        check: &["usr/include/gtest/gtest.h"],
    },
    Toolchain {
        name: "node",
        apt: &["nodejs", "npm"],
        pip: &[],
        npm: &["typescript@5", "tsx@4", "jest@29"],
        lower: &[],
        env: &[("NODE_PATH", "/opt/sandlot/node/lib/node_modules")],
        // run_code's jest config names babel-jest and Debian's babel presets by path.
        check: &[
            "usr/bin/node",
            "opt/sandlot/node/bin/tsc",
            "opt/sandlot/node/bin/jest",
            "opt/sandlot/node/lib/node_modules/jest/node_modules/babel-jest",
            "usr/share/nodejs/@babel/preset-env",
            "usr/share/nodejs/@babel/preset-typescript",
        ],
    },
    Toolchain {
        name: "go",
        // Debian's Go source packages (under /usr/share/gocode, on run_code's GOPATH) of
        // the modules SandboxFusion's runtime/go/go.mod requires, where Debian 12 has them.
        apt: &[
            "golang-go",
            "golang-github-stretchr-testify-dev",
            "golang-github-sirupsen-logrus-dev",
            "golang-github-spf13-cobra-dev",
            "golang-github-spf13-pflag-dev",
            "golang-github-google-uuid-dev",
            "golang-github-opentracing-opentracing-go-dev",
            "golang-github-go-openapi-inflect-dev",
            "golang-go.uber-atomic-dev",
            "golang-go.uber-zap-dev",
            "golang-gopkg-yaml.v2-dev",
            "golang-gopkg-yaml.v3-dev",
            "golang-golang-x-text-dev",
            "golang-golang-x-exp-dev",
        ],
        pip: &[],
        npm: &[],
        lower: &[],
        env: &[("GOCACHE", "/tmp/go-cache"), ("GOFLAGS", "-mod=mod")],
        check: &[
            "usr/bin/go",
            "usr/share/gocode/src/github.com/stretchr/testify/assert",
        ],
    },
    Toolchain {
        name: "java",
        // javatuples: SandboxFusion's java runner has it on the class path.
        apt: &["openjdk-17-jdk-headless", "junit5", "libjavatuples-java"],
        pip: &[],
        npm: &[],
        lower: &[],
        env: &[(
            "SANDLOT_JUNIT_JAR",
            "/usr/share/java/junit-platform-console-standalone.jar",
        )],
        check: &[
            "usr/bin/javac",
            "usr/share/java/junit-platform-console-standalone.jar",
            "usr/share/java/javatuples.jar",
        ],
    },
    Toolchain {
        name: "rust",
        apt: &["rustc"],
        pip: &[],
        npm: &[],
        lower: &[],
        env: &[],
        check: &["usr/bin/rustc"],
    },
    Toolchain {
        name: "php",
        apt: &["php-cli"],
        pip: &[],
        npm: &[],
        lower: &[],
        env: &[],
        check: &["usr/bin/php"],
    },
    Toolchain {
        name: "ruby",
        apt: &["ruby"],
        pip: &[],
        npm: &[],
        lower: &[],
        env: &[],
        check: &["usr/bin/ruby"],
    },
    Toolchain {
        name: "lua",
        // LuaUnit (`require('luaunit')`), as SandboxFusion's lua tests use.
        apt: &["lua5.4", "lua-unit"],
        pip: &[],
        npm: &[],
        lower: &[],
        env: &[],
        check: &["usr/bin/lua5.4", "usr/share/lua/5.4/luaunit.lua"],
    },
    Toolchain {
        name: "perl",
        // Test::Deep and Data::Compare, as SandboxFusion's perl tests use.
        apt: &["perl", "libtest-deep-perl", "libdata-compare-perl"],
        pip: &[],
        npm: &[],
        lower: &[],
        env: &[],
        check: &[
            "usr/bin/perl",
            "usr/share/perl5/Test/Deep.pm",
            "usr/share/perl5/Data/Compare.pm",
        ],
    },
    Toolchain {
        name: "r",
        apt: &["r-base-core"],
        pip: &[],
        npm: &[],
        lower: &[],
        env: &[],
        check: &["usr/bin/Rscript"],
    },
    Toolchain {
        name: "csharp",
        // System.Net.Http: run_code's C# prelude has .NET's implicit `using System.Net.Http`.
        apt: &["mono-mcs", "mono-runtime", "libmono-system-net-http4.0-cil"],
        pip: &[],
        npm: &[],
        lower: &[],
        env: &[],
        check: &[
            "usr/bin/mcs",
            "usr/bin/mono",
            "usr/lib/mono/4.5/System.Net.Http.dll",
        ],
    },
    Toolchain {
        name: "scala",
        apt: &["scala"],
        pip: &[],
        npm: &[],
        lower: &["java"],
        env: &[],
        check: &["usr/bin/scala"],
    },
    Toolchain {
        name: "kotlin",
        apt: &["kotlin"],
        pip: &[],
        npm: &[],
        lower: &["java"],
        env: &[],
        check: &["usr/bin/kotlinc"],
    },
    Toolchain {
        name: "d",
        apt: &["gdc"],
        pip: &[],
        npm: &[],
        lower: &[],
        env: &[],
        check: &["usr/bin/gdc"],
    },
    Toolchain {
        name: "racket",
        apt: &["racket"],
        pip: &[],
        npm: &[],
        lower: &[],
        env: &[],
        check: &["usr/bin/racket"],
    },
    Toolchain {
        name: "verilog",
        apt: &["iverilog"],
        pip: &[],
        npm: &[],
        lower: &[],
        env: &[],
        check: &["usr/bin/iverilog"],
    },
    Toolchain {
        name: "sql",
        apt: &["sqlite3"],
        pip: &[],
        npm: &[],
        lower: &[],
        env: &[],
        check: &["usr/bin/sqlite3"],
    },
];

/// The toolchain an image name `lang-<name>` names, if any.
pub fn toolchain_for_image(image: &str) -> Option<&'static Toolchain> {
    let name = image.strip_prefix("lang-")?;
    TOOLCHAINS.iter().find(|t| t.name == name)
}

/// Version of the build steps (the install script's clean-up, the mounts): part of every
/// recipe, so a change rebuilds the layers.
const RECIPE_VERSION: u32 = 2;

/// What a toolchain layer is built from; its SHA-256 names the layer directory.
#[derive(serde::Serialize)]
struct Recipe<'a> {
    /// [`RECIPE_VERSION`]: bumped when the build itself changes.
    version: u32,
    toolchain: &'a str,
    apt: &'a [&'a str],
    pip: &'a [&'a str],
    npm: &'a [&'a str],
    /// The stack it is built on, top first (store-relative paths).
    lowers: &'a [String],
    /// The base image's build time: a rebuilt base makes every layer on it new.
    base_created_at: &'a str,
}

impl ImageStore {
    /// Build image `lang-<name>` (a row of [`TOOLCHAINS`]) and the layers it needs, over
    /// the `python` image (built first when missing, its debootstrap tree cached under
    /// `cache_dir`). Layers already built from the same recipe are reused; the image is
    /// rewritten only when its layer stack changed (or with `force`, which also rebuilds
    /// this toolchain's own layer). Progress and the time per layer go to stderr.
    ///
    /// # Errors
    /// `InvalidArgument` when `image` is not `lang-<name>` of a known toolchain;
    /// `Unavailable` when not root; `Internal` when an install step fails (its output is on
    /// stderr) or a `check` path is missing afterwards, and on I/O failure. A failed build
    /// leaves no layer behind (its temp dir is unmounted and removed).
    pub fn build_toolchain(&self, image: &str, cache_dir: &Path, force: bool) -> NodeResult<Image> {
        let tc = toolchain_for_image(image).ok_or_else(|| {
            NodeError::InvalidArgument(format!(
                "unknown toolchain image {image:?} (known: {})",
                TOOLCHAINS
                    .iter()
                    .map(|t| format!("lang-{}", t.name))
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })?;
        if !nix::unistd::Uid::effective().is_root() {
            return Err(NodeError::Unavailable(
                "building a toolchain layer needs root (overlay mount, chroot)".into(),
            ));
        }
        let base = self.build_python_with(cache_dir, false)?;
        // Shared store lock: `gc` (exclusive) cannot collect a layer between its build and
        // the image.json that names it.
        let _store = self.lock(false)?;
        let stack = self.toolchain_stack(tc, &base, cache_dir, force)?;
        let mut rels = stack.clone();
        rels.push(format!("{}/{ROOTFS_DIR}", base.name));
        let key = ImageName::Short(image.to_string());
        let mut env = vec![(
            "PATH".to_string(),
            format!("{NODE_PREFIX}/bin:{DEFAULT_PATH}"),
        )];
        env.extend(base.env.iter().filter(|(k, _)| k != "PATH").cloned());
        collect_env(tc, &mut env);
        if !force {
            // An unreadable image.json (another builder's format) is replaced below.
            if let Ok(Some(img)) = self.load(&key) {
                let now: Vec<PathBuf> = rels.iter().map(|r| self.dir.join(r)).collect();
                if img.layers == now && img.env == env {
                    return Ok(img);
                }
            }
        }
        let mut size_bytes = 0;
        for r in &rels {
            size_bytes += tree_size(&self.dir.join(r))?;
        }
        let meta = ImageJson {
            name: image.to_string(),
            env,
            workdir: Some("/workspace".into()),
            user: None,
            created_at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            size_bytes,
            source: ImageSource::Toolchain {
                toolchain: tc.name.to_string(),
                apt: tc.apt.iter().map(|s| s.to_string()).collect(),
                pip: tc.pip.iter().map(|s| s.to_string()).collect(),
                npm: tc.npm.iter().map(|s| s.to_string()).collect(),
            },
            layers: rels,
            blobs: vec![],
        };
        self.install_meta(image, &meta)
    }

    /// The toolchain layers of `tc`'s image, top first (store-relative), building those
    /// that do not exist yet. `force` rebuilds `tc`'s own layer (not its lowers).
    fn toolchain_stack(
        &self,
        tc: &Toolchain,
        base: &Image,
        cache_dir: &Path,
        force: bool,
    ) -> NodeResult<Vec<String>> {
        let mut lowers: Vec<String> = Vec::new();
        for l in tc.lower {
            let lower = TOOLCHAINS
                .iter()
                .find(|t| t.name == *l)
                .ok_or_else(|| failed(format!("toolchain {} names unknown lower {l}", tc.name)))?;
            for r in self.toolchain_stack(lower, base, cache_dir, false)? {
                if !lowers.contains(&r) {
                    lowers.push(r);
                }
            }
        }
        let recipe = Recipe {
            version: RECIPE_VERSION,
            toolchain: tc.name,
            apt: tc.apt,
            pip: tc.pip,
            npm: tc.npm,
            lowers: &lowers,
            base_created_at: &base.created_at,
        };
        let hex = format!(
            "{:x}",
            Sha256::digest(serde_json::to_vec(&recipe).expect("recipe serializes"))
        );
        let rel = format!("{LAYERS_DIR}/{hex}");
        let dst = self.dir.join(&rel);
        if force && dst.exists() {
            fs::remove_dir_all(&dst)
                .map_err(|e| NodeError::io(format!("remove {}", dst.display()), e))?;
        }
        if !dst.exists() {
            let mut below: Vec<PathBuf> = lowers.iter().map(|r| self.dir.join(r)).collect();
            below.extend(base.layers.iter().cloned());
            // One build at a time per cache dir: apt's caches are shared and locked.
            let _apt = lock_file(&cache_dir.join("toolchain-build.lock"))?;
            let t0 = Instant::now();
            eprintln!("toolchain layer {}: building ({rel})", tc.name);
            build_layer(tc, &below, &dst, cache_dir)?;
            eprintln!(
                "toolchain layer {}: built in {:.1} s, {} MiB",
                tc.name,
                t0.elapsed().as_secs_f64(),
                tree_size(&dst).unwrap_or(0) >> 20
            );
        }
        let mut stack = vec![rel];
        stack.extend(lowers);
        Ok(stack)
    }
}

/// An exclusive `flock` on `path` (created when missing), held until the value drops.
fn lock_file(path: &Path) -> NodeResult<nix::fcntl::Flock<fs::File>> {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir)
            .map_err(|e| NodeError::io(format!("create {}", dir.display()), e))?;
    }
    let f = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(|e| NodeError::io(format!("open {}", path.display()), e))?;
    nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| NodeError::io(format!("flock {}", path.display()), e.into()))
}

/// A build step that failed (its output went to stderr).
fn failed(msg: String) -> NodeError {
    NodeError::io(msg, io::ErrorKind::Other.into())
}

/// The image env of `tc` and its lowers (lowers first).
fn collect_env(tc: &Toolchain, out: &mut Vec<(String, String)>) {
    for l in tc.lower {
        if let Some(lower) = TOOLCHAINS.iter().find(|t| t.name == *l) {
            collect_env(lower, out);
        }
    }
    for (k, v) in tc.env {
        if !out.iter().any(|(ok, _)| ok == k) {
            out.push((k.to_string(), v.to_string()));
        }
    }
}

/// The shell script run in the chroot for `tc`.
fn install_script(tc: &Toolchain) -> String {
    let mut s = String::from("set -eu\nexport DEBIAN_FRONTEND=noninteractive\n");
    if !tc.apt.is_empty() || !tc.pip.is_empty() || !tc.npm.is_empty() {
        s.push_str("apt-get update -qq\n");
        s.push_str(&format!(
            "apt-get install -y -qq --no-install-recommends {}\n",
            tc.apt.join(" ")
        ));
    }
    if !tc.pip.is_empty() {
        let quoted: Vec<String> = tc.pip.iter().map(|p| format!("'{p}'")).collect();
        s.push_str(&format!(
            "python3 -m pip install -q --no-cache-dir --break-system-packages --disable-pip-version-check {}\n",
            quoted.join(" ")
        ));
    }
    if !tc.npm.is_empty() {
        s.push_str(&format!(
            "npm install -g --no-fund --no-audit --loglevel=error --prefix {NODE_PREFIX} {}\n\
             rm -rf /root/.npm\n",
            tc.npm.join(" ")
        ));
    }
    // apt's binary package caches (~70 MiB) are rebuilt on demand: not part of a layer.
    s.push_str(
        "rm -rf /root/.cache /var/log/apt /var/log/dpkg.log /var/cache/debconf/*-old \
         /var/cache/apt/*.bin\n",
    );
    s
}

/// Build `tc`'s layer at `dst` over `below` (top first): an overlay of `below` with a fresh
/// upper dir, the install script run in a chroot of it, the upper dir moved to `dst`.
fn build_layer(tc: &Toolchain, below: &[PathBuf], dst: &Path, cache_dir: &Path) -> NodeResult<()> {
    let parent = dst.parent().expect("layer dir has a parent");
    let name = dst
        .file_name()
        .expect("layer dir has a name")
        .to_string_lossy();
    let tmp = parent.join(format!(".{name}.build-{}", std::process::id()));
    if tmp.exists() {
        unmount_under(&tmp)?;
        fs::remove_dir_all(&tmp)
            .map_err(|e| NodeError::io(format!("remove {}", tmp.display()), e))?;
    }
    let (upper, work, root) = (tmp.join("upper"), tmp.join("work"), tmp.join("root"));
    for d in [&upper, &work, &root] {
        fs::create_dir_all(d).map_err(|e| NodeError::io(format!("create {}", d.display()), e))?;
    }
    let result = (|| {
        let lowerdir = below
            .iter()
            .map(|p| p.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(":");
        let opts = format!(
            "lowerdir={lowerdir},upperdir={},workdir={}",
            upper.display(),
            work.display()
        );
        mount(
            Some("overlay"),
            &root,
            Some("overlay"),
            MsFlags::empty(),
            Some(opts.as_str()),
        )
        .map_err(|e| NodeError::io(format!("mount overlay on {}", root.display()), e.into()))?;
        chroot_mounts(&root, cache_dir)?;
        let mut cmd = Command::new("chroot");
        cmd.arg(&root)
            .args(["/bin/sh", "-c", &install_script(tc)])
            .env_clear()
            .env("PATH", DEFAULT_PATH)
            .env("HOME", "/root")
            .env("LANG", "C.UTF-8");
        if Path::new(HOST_CA_BUNDLE).is_file() {
            for k in [
                "PIP_CERT",
                "SSL_CERT_FILE",
                "REQUESTS_CA_BUNDLE",
                "NODE_EXTRA_CA_CERTS",
                "npm_config_cafile",
            ] {
                cmd.env(k, BUILD_CA_BUNDLE);
            }
        }
        for k in PASSED_ENV {
            if let Some(v) = std::env::var_os(k) {
                cmd.env(k, v);
            }
        }
        let status = cmd
            .stdin(Stdio::null())
            .status()
            .map_err(|e| NodeError::io("run chroot", e))?;
        if !status.success() {
            return Err(failed(format!(
                "installing toolchain {} failed ({status}); its output is above",
                tc.name
            )));
        }
        for p in tc.check {
            if fs::symlink_metadata(root.join(p)).is_err() {
                return Err(failed(format!(
                    "toolchain {} installed but /{p} is missing",
                    tc.name
                )));
            }
        }
        Ok(())
    })();
    // Unmount everything (also on failure) before touching the upper dir.
    let unmounted = unmount_under(&root).and_then(|_| match umount2(&root, MntFlags::MNT_DETACH) {
        Ok(()) | Err(nix::errno::Errno::EINVAL) => Ok(()),
        Err(e) => Err(NodeError::io(
            format!("unmount {}", root.display()),
            e.into(),
        )),
    });
    let result = result.and(unmounted).and_then(|_| {
        // The mount points made for the build are not part of the layer.
        clean_upper(&upper)?;
        fs::rename(&upper, dst)
            .map_err(|e| NodeError::io(format!("rename to {}", dst.display()), e))?;
        fsync_dir(parent)
    });
    if let Err(e) = fs::remove_dir_all(&tmp) {
        tracing::warn!(path = %tmp.display(), error = %e, "cannot remove toolchain build dir");
    }
    result
}

/// Debian's CA bundle on the host.
const HOST_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";
/// Where the build sees the host's CA bundle.
const BUILD_CA_BUNDLE: &str = "/run/sandlot-build-ca.crt";
/// Host environment passed to the install (proxies and package indexes), when set.
const PASSED_ENV: &[&str] = &[
    "http_proxy",
    "https_proxy",
    "no_proxy",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "PIP_INDEX_URL",
    "PIP_EXTRA_INDEX_URL",
    "PIP_DEFAULT_TIMEOUT",
    "npm_config_registry",
];

/// Bind mounts the install needs: `/proc`, a `/dev` with the usual character devices, the
/// host's resolver config, and the apt caches.
fn chroot_mounts(root: &Path, cache_dir: &Path) -> NodeResult<()> {
    let m = |src: &Path, dst: &Path, fstype: Option<&str>, flags: MsFlags| {
        mount(Some(src), dst, fstype, flags, None::<&str>)
            .map_err(|e| NodeError::io(format!("mount {}", dst.display()), e.into()))
    };
    m(
        Path::new("proc"),
        &root.join("proc"),
        Some("proc"),
        MsFlags::empty(),
    )?;
    let dev = root.join("dev");
    m(Path::new("tmpfs"), &dev, Some("tmpfs"), MsFlags::MS_NOSUID)?;
    for d in ["null", "zero", "full", "random", "urandom", "tty"] {
        let target = dev.join(d);
        fs::write(&target, b"")
            .map_err(|e| NodeError::io(format!("create {}", target.display()), e))?;
        m(&Path::new("/dev").join(d), &target, None, MsFlags::MS_BIND)?;
    }
    // The host's CA bundle, for pip and npm over HTTPS (an egress proxy's CA included),
    // where the build sees it: /run is a tmpfs, so it never lands in the layer.
    let run = root.join("run");
    fs::create_dir_all(&run).map_err(|e| NodeError::io(format!("create {}", run.display()), e))?;
    m(Path::new("tmpfs"), &run, Some("tmpfs"), MsFlags::MS_NOSUID)?;
    let host_ca = Path::new(HOST_CA_BUNDLE);
    if host_ca.is_file() {
        let ca = root.join(BUILD_CA_BUNDLE.trim_start_matches('/'));
        fs::write(&ca, b"").map_err(|e| NodeError::io(format!("create {}", ca.display()), e))?;
        m(host_ca, &ca, None, MsFlags::MS_BIND)?;
    }
    let resolv = root.join("etc/resolv.conf");
    if fs::symlink_metadata(&resolv).is_err() {
        fs::write(&resolv, b"")
            .map_err(|e| NodeError::io(format!("create {}", resolv.display()), e))?;
    }
    m(
        Path::new("/etc/resolv.conf"),
        &resolv,
        None,
        MsFlags::MS_BIND,
    )?;
    for (sub, inside) in [
        ("apt-lists", "var/lib/apt/lists"),
        ("apt-archives", "var/cache/apt/archives"),
    ] {
        let src = cache_dir.join(sub);
        fs::create_dir_all(src.join("partial"))
            .map_err(|e| NodeError::io(format!("create {}", src.display()), e))?;
        let target = root.join(inside);
        fs::create_dir_all(&target)
            .map_err(|e| NodeError::io(format!("create {}", target.display()), e))?;
        m(&src, &target, None, MsFlags::MS_BIND)?;
    }
    Ok(())
}

/// Drop from a finished upper dir what only the build put there: the mount points' copies
/// (`/proc`, `/dev`, `etc/resolv.conf` when the base had none, the apt cache dirs) when
/// they hold nothing of the install, and the overlay's leftovers.
fn clean_upper(upper: &Path) -> NodeResult<()> {
    for p in ["dev", "proc", "run"] {
        let d = upper.join(p);
        // Created as copy-up of the base's dir for the mount point: empty, drop it.
        if d.is_dir()
            && fs::read_dir(&d)
                .map(|mut r| r.next().is_none())
                .unwrap_or(false)
        {
            let _ = fs::remove_dir(&d);
        }
    }
    for p in ["var/lib/apt/lists", "var/cache/apt/archives"] {
        let d = upper.join(p);
        if d.is_dir() {
            fs::remove_dir_all(&d)
                .map_err(|e| NodeError::io(format!("remove {}", d.display()), e))?;
        }
    }
    let resolv = upper.join("etc/resolv.conf");
    if fs::metadata(&resolv).map(|m| m.len() == 0).unwrap_or(false) {
        fs::remove_file(&resolv)
            .map_err(|e| NodeError::io(format!("remove {}", resolv.display()), e))?;
    }
    Ok(())
}

/// Sizes of an image's layers, top first: `(store-relative path, bytes)`.
///
/// # Errors
/// `Internal` on I/O failure while walking a layer.
pub fn layer_sizes(store_dir: &Path, image: &Image) -> NodeResult<Vec<(String, u64)>> {
    image
        .layers
        .iter()
        .map(|l| {
            let rel = l
                .strip_prefix(store_dir)
                .unwrap_or(l)
                .to_string_lossy()
                .into_owned();
            Ok((rel, tree_size(l)?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_lower_names_an_earlier_toolchain() {
        for (i, t) in TOOLCHAINS.iter().enumerate() {
            for l in t.lower {
                let j = TOOLCHAINS.iter().position(|u| u.name == *l);
                assert!(matches!(j, Some(j) if j < i), "{} lower {l}", t.name);
            }
        }
    }

    #[test]
    fn image_names_map_to_toolchains() {
        assert_eq!(toolchain_for_image("lang-go").map(|t| t.name), Some("go"));
        assert!(toolchain_for_image("go").is_none());
        assert!(toolchain_for_image("lang-cobol").is_none());
    }

    #[test]
    fn install_script_installs_each_kind() {
        let node = toolchain_for_image("lang-node").unwrap();
        let s = install_script(node);
        assert!(s.contains("apt-get install -y -qq --no-install-recommends nodejs npm"));
        assert!(s.contains("npm install -g") && s.contains("typescript@5"));
        let py = install_script(toolchain_for_image("lang-python").unwrap());
        assert!(py.contains("--break-system-packages") && py.contains("'numpy<2'"));
    }

    #[test]
    fn env_of_lowers_comes_along() {
        let mut env = Vec::new();
        collect_env(toolchain_for_image("lang-scala").unwrap(), &mut env);
        assert!(env.iter().any(|(k, _)| k == "SANDLOT_JUNIT_JAR"));
    }
}
