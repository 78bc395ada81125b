//! Ava's CUDA C kernels on the CPU, for tests on machines without a GPU (CI, a laptop).
//!
//! [`Emulator::build`] compiles kernel files (`.cu`) as C++ with the system's C++ compiler,
//! `emu/ava_emu.h` included first, together with the scheduler `emu/runtime.cpp`, into a
//! shared library, and loads it. [`Emulator::launch`] then runs a grid the way a GPU would
//! order it: blocks one after another, a block's threads as fibers, each running until it
//! reaches `__syncthreads`, a warp-level operation or its end; `__syncthreads` opens when the
//! whole block has arrived, a warp operation (shuffle, ballot, `__syncwarp`, `ldmatrix`,
//! `mma.sync`) when the warp's 32 lanes have, and exchanges their values as the PTX ISA lays
//! them out. The kernel's source is the one nvcc builds: only its inline PTX needs an
//! `#ifdef AVA_EMULATE` branch calling the emulator's (`ava_emu::mma16816`,
//! `ava_emu::ldmatrix_x4`), and its dynamic shared memory is declared through
//! `AVA_DYNAMIC_SHARED(name)` (`<ava/common.cuh>` defines it for nvcc).
//!
//! [`Emulator::call`] takes a kernel's arguments as `cuLaunchKernel` does (one address per
//! parameter), so a launcher written for the driver runs here unchanged: the build lists each
//! file's `extern "C"` kernels (from the preprocessed source) and compiles, beside each file, a
//! function that unpacks such an array into that kernel's parameter types.
//!
//! What it finds that a reading does not: a kernel's results against the CPU engine's, warps
//! split between barriers or shuffling with lanes that returned (the launch fails saying
//! which block and warp), `ldmatrix` rows outside shared memory or misaligned, and, run again
//! in the other [`Order`]s, a thread reading what another wrote without a barrier between
//! (the outputs differ). Dynamic shared memory starts as 0xff bytes (NaN floats), so a read
//! before any write shows; `__shared__` variables keep what the previous block left, which
//! differs between the orders (the reversed one runs the blocks last first). What it does not
//! model: timing, the memory model beyond barriers, atomics' contention, the device's
//! approximate math (`__expf` is `expf`; NaNs keep their payload). It is stricter than CUDA
//! in places, and says so when refusing: partial-warp masks, a warp operation after some of
//! the warp's lanes returned, `ldmatrix` on a `__shared__` static (only dynamic shared memory
//! is checked as shared). A kernel that passes here can still fail on a GPU; one that fails
//! here has a bug or uses one of those patterns.
//!
//! Launches of one loaded library are serialized (a lock in it): `__shared__` variables are
//! statics, one per kernel. The fibers switch by x86-64 assembly; other targets use ucontext
//! (slower, and not exercised by CI). Needs a C++17 compiler with `_Float16` (GCC 12 or
//! Clang 15 and newer on x86-64).

use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_void};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::process::Command;

/// What can go wrong building, loading or running emulated kernels.
#[derive(Debug, thiserror::Error)]
pub enum EmuError {
    /// A file could not be read or written.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The C++ compiler could not be started.
    #[error(
        "could not run the C++ compiler `{compiler}` ({source}): the kernel emulator needs one (install g++ or \
         clang++, or name it in CXX)"
    )]
    NoCompiler {
        /// The command tried.
        compiler: String,
        /// Why it did not start.
        source: std::io::Error,
    },
    /// The kernels did not compile.
    #[error("compiling {sources} for the kernel emulator failed:\n{stderr}")]
    Compile {
        /// The kernel files.
        sources: String,
        /// The compiler's messages.
        stderr: String,
    },
    /// The compiled library did not load, or lacks a kernel.
    #[error("{0}")]
    Load(String),
    /// A launch was refused or failed while it ran.
    #[error("emulated launch of {kernel}: {why}")]
    Launch {
        /// The kernel's name, as the caller gave it.
        kernel: String,
        /// What happened (which block, warp or thread, and what it did).
        why: String,
    },
}

/// The order in which a block's threads run between two `__syncthreads`. A kernel whose
/// output differs between the orders reads what another thread (or warp) writes without a
/// barrier between, or a `__shared__` variable before writing it: a test of a kernel runs it
/// in each of [`Order::ALL`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// Threads in index order, the warps advancing together from one warp-level operation to
    /// the next.
    Lockstep,
    /// Warp after warp, the first first, each run through its warp-level operations up to the
    /// next `__syncthreads` before the next warp starts: a warp reads what a later warp has
    /// not written yet, and an earlier warp has already moved on and overwritten what a later
    /// one still has to read.
    Serial,
    /// As [`Serial`](Self::Serial) with the last warp first, its lanes last first, and the
    /// blocks last first (so a `__shared__` static read before it is written holds another
    /// block's leftovers).
    SerialReversed,
}

impl Order {
    /// Every order, lockstep first.
    pub const ALL: [Order; 3] = [Order::Lockstep, Order::Serial, Order::SerialReversed];

    fn code(self) -> c_int {
        match self {
            Order::Lockstep => 0,
            Order::Serial => 1,
            Order::SerialReversed => 2,
        }
    }
}

/// A launch's shape: grid and block (x, y, z) and dynamic shared memory in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Blocks along x, y, z.
    pub grid: (u32, u32, u32),
    /// Threads a block along x, y, z.
    pub block: (u32, u32, u32),
    /// Dynamic shared memory, bytes.
    pub shared: usize,
}

impl Shape {
    /// A one-dimensional launch: `blocks` blocks of `threads` threads.
    pub fn linear(blocks: u32, threads: u32) -> Self {
        Self { grid: (blocks, 1, 1), block: (threads, 1, 1), shared: 0 }
    }
}

/// Kernel files to compile for the emulator.
#[derive(Debug, Clone, Default)]
pub struct Build {
    /// The kernel files (`.cu`), compiled as C++.
    pub sources: Vec<PathBuf>,
    /// Include directories (after the emulator's own, which stand in for CUDA's headers).
    pub includes: Vec<PathBuf>,
    /// Where the library goes ([`cache_dir`], or a test's `CARGO_TARGET_TMPDIR`); rebuilt
    /// when an input changes. Created if absent.
    pub out_dir: PathBuf,
}

type LaunchFn = unsafe extern "C" fn(
    grid: *const c_uint,
    block: *const c_uint,
    shared: usize,
    order: c_int,
    body: unsafe extern "C" fn(*mut c_void),
    ctx: *mut c_void,
    why: *mut c_char,
    why_len: usize,
) -> c_int;

/// A loaded library of emulated kernels. Never unloaded: a test may hold kernel pointers
/// until it exits.
#[derive(Debug)]
pub struct Emulator {
    handle: *mut c_void,
    launch: LaunchFn,
    path: PathBuf,
}

// SAFETY: the library's launches take a process-wide lock; the handle is only read.
unsafe impl Send for Emulator {}
// SAFETY: as above.
unsafe impl Sync for Emulator {}

/// A directory of this user's own for the compiled libraries, `$TMPDIR/ava-cuda-emu-$UID`:
/// created readable by this user only, and refused if another user owns it or can write to
/// it, or if it is a symbolic link another user made (wherever it leads: a library found
/// there is loaded into the test).
pub fn cache_dir() -> Result<PathBuf, EmuError> {
    cache_dir_in(&std::env::temp_dir())
}

/// [`cache_dir`] in `tmp`.
fn cache_dir_in(tmp: &Path) -> Result<PathBuf, EmuError> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    let dir = tmp.join(format!("ava-cuda-emu-{uid}"));
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(source) => return Err(EmuError::Io { what: "creating", path: dir, source }),
    }
    let reading = |source| EmuError::Io { what: "reading", path: dir.clone(), source };
    let link = std::fs::symlink_metadata(&dir).map_err(reading)?;
    if link.file_type().is_symlink() && link.uid() != uid && link.uid() != 0 {
        return Err(EmuError::Load(format!(
            "{} is a symbolic link owned by uid {}, another user: not followed; remove it, or name another TMPDIR",
            dir.display(),
            link.uid()
        )));
    }
    let meta = std::fs::metadata(&dir).map_err(reading)?;
    if !meta.is_dir() || meta.uid() != uid || meta.mode() & 0o022 != 0 {
        return Err(EmuError::Load(format!(
            "{} is not this user's own (owner {}, mode {:o}): remove it, or name another TMPDIR",
            dir.display(),
            meta.uid(),
            meta.mode() & 0o777
        )));
    }
    Ok(dir)
}

/// The emulator's own files.
fn emu_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("emu")
}

fn read(path: &Path) -> Result<Vec<u8>, EmuError> {
    std::fs::read(path).map_err(|source| EmuError::Io { what: "reading", path: path.to_path_buf(), source })
}

/// The compiler's flags: C++17, optimized enough to run, no contraction of a·b + c into one
/// rounding (nvcc's --fmad=false, which the bit-exact kernels are built with); on x86-64 no
/// control-flow protection (a fiber's first switch returns into its entry function, which a
/// shadow stack would refuse).
const FLAGS: &[&str] = &[
    "-std=c++17",
    "-O1",
    "-g0",
    "-fPIC",
    "-shared",
    "-ffp-contract=off",
    "-fno-strict-aliasing",
    #[cfg(target_arch = "x86_64")]
    "-fcf-protection=none",
];

impl Emulator {
    /// Compiles `build`'s kernels with the emulator (or reuses the library an identical build
    /// left in `out_dir`) and loads them.
    pub fn build(build: &Build) -> Result<Self, EmuError> {
        let emu = emu_dir();
        let runtime = emu.join("runtime.cpp");
        let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
        // The library's name: a hash of everything that goes into it, the compiler's version too.
        let version = Command::new(&compiler)
            .arg("--version")
            .output()
            .map_err(|source| EmuError::NoCompiler { compiler: compiler.clone(), source })?;
        let mut h = DefaultHasher::new();
        (FLAGS, &compiler, &version.stdout, &build.includes).hash(&mut h);
        for file in ["ava_emu.h", "ava_emu_call.h", "runtime.cpp", "include/ava_emu_types.h"].map(|f| emu.join(f)) {
            read(&file)?.hash(&mut h);
        }
        for source in &build.sources {
            (source, read(source)?).hash(&mut h);
        }
        for dir in &build.includes {
            hash_headers(dir, &mut h)?;
        }
        let stem = build.sources.first().and_then(|s| s.file_stem()).map_or("kernels".into(), |s| s.to_string_lossy());
        let hash = h.finish();
        std::fs::create_dir_all(&build.out_dir).map_err(|source| EmuError::Io {
            what: "creating",
            path: build.out_dir.clone(),
            source,
        })?;
        let path = build.out_dir.join(format!("ava-emu-{stem}-{hash:016x}.so"));
        if !path.exists() {
            compile(&compiler, build, &emu, &runtime, &path, hash)?;
        }
        Self::load(path)
    }

    fn load(path: PathBuf) -> Result<Self, EmuError> {
        let c = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|e| EmuError::Load(e.to_string()))?;
        // SAFETY: a library this crate just compiled; its initializers are the C++ runtime's.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(EmuError::Load(format!("loading {}: {}", path.display(), dl_error())));
        }
        // SAFETY: runtime.cpp defines ava_emu_launch with exactly LaunchFn's signature.
        let launch = unsafe { symbol::<LaunchFn>(handle, &path, "ava_emu_launch")? };
        Ok(Self { handle, launch, path })
    }

    /// The kernel (or any exported function) `name` as a function pointer of type `F`.
    ///
    /// # Safety
    /// `F` must be an `unsafe extern "C" fn` type with the kernel's exact parameters, and the
    /// function may only be called from inside [`launch`](Self::launch)'s body.
    pub unsafe fn kernel<F: Copy>(&self, name: &str) -> Result<F, EmuError> {
        // SAFETY: the caller's promise about F, passed on.
        unsafe { symbol(self.handle, &self.path, name) }
    }

    /// Runs `body` as every thread of a `shape` launch, the threads of a block in `order`.
    /// `body` calls the kernel (from [`kernel`](Self::kernel)) with its arguments; `kernel`
    /// names it in errors.
    pub fn launch(&self, kernel: &str, shape: Shape, order: Order, body: impl Fn()) -> Result<(), EmuError> {
        struct Ctx<'a> {
            body: &'a dyn Fn(),
            panicked: std::sync::Mutex<Option<String>>,
        }
        unsafe extern "C" fn trampoline(ctx: *mut c_void) {
            // SAFETY: ctx is the Ctx below, alive for the whole launch.
            let ctx = unsafe { &*(ctx as *const Ctx<'_>) };
            if let Err(p) = catch_unwind(AssertUnwindSafe(ctx.body)) {
                let why =
                    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
                let mut slot = ctx.panicked.lock().unwrap_or_else(|e| e.into_inner());
                slot.get_or_insert(why.unwrap_or_else(|| "a thread's body panicked".into()));
            }
        }
        let ctx = Ctx { body: &body, panicked: std::sync::Mutex::new(None) };
        let grid = [shape.grid.0, shape.grid.1, shape.grid.2];
        let block = [shape.block.0, shape.block.1, shape.block.2];
        let mut why = vec![0 as c_char; 1024];
        // SAFETY: the arrays and ctx outlive the call, which runs every fiber to its end.
        let failed = unsafe {
            (self.launch)(
                grid.as_ptr(),
                block.as_ptr(),
                shape.shared,
                order.code(),
                trampoline,
                (&ctx as *const Ctx<'_>).cast_mut().cast(),
                why.as_mut_ptr(),
                why.len(),
            )
        };
        if let Some(p) = ctx.panicked.into_inner().unwrap_or_else(|e| e.into_inner()) {
            return Err(EmuError::Launch { kernel: kernel.to_string(), why: format!("the body panicked: {p}") });
        }
        if failed != 0 {
            // SAFETY: the runtime wrote a NUL-terminated message into why.
            let why = unsafe { CStr::from_ptr(why.as_ptr()) }.to_string_lossy().into_owned();
            return Err(EmuError::Launch { kernel: kernel.to_string(), why });
        }
        Ok(())
    }
}

impl Emulator {
    /// Runs kernel `kernel` as a `shape` launch with `params` as `cuLaunchKernel` takes them:
    /// one address a parameter, in order. Refused when the kernel takes another number of
    /// parameters.
    ///
    /// # Safety
    /// Each address must point at a value of the kernel's parameter type, and every pointer
    /// among those values must be valid for what the kernel reads and writes.
    pub unsafe fn call(
        &self,
        kernel: &str,
        shape: Shape,
        order: Order,
        params: &mut [*mut c_void],
    ) -> Result<(), EmuError> {
        type Call = unsafe extern "C" fn(*mut *mut c_void);
        type Arity = unsafe extern "C" fn() -> c_uint;
        // SAFETY: the build defines both with these signatures for every kernel it found.
        let (call, arity) = unsafe {
            (
                self.kernel::<Call>(&format!("ava_emu_call_{kernel}"))?,
                self.kernel::<Arity>(&format!("ava_emu_arity_{kernel}"))?,
            )
        };
        // SAFETY: a function of no arguments.
        let takes = unsafe { arity() } as usize;
        if takes != params.len() {
            return Err(EmuError::Launch {
                kernel: kernel.to_string(),
                why: format!("the kernel takes {takes} parameters, the launch gives {}", params.len()),
            });
        }
        let p = params.as_mut_ptr();
        // SAFETY: the caller's promise about params; the array outlives the launch.
        self.launch(kernel, shape, order, || unsafe { call(p) })
    }
}

/// The function `name` of the loaded library `handle` (from `path`) as a function pointer of
/// type `F`.
///
/// # Safety
/// As [`Emulator::kernel`].
unsafe fn symbol<F: Copy>(handle: *mut c_void, path: &Path, name: &str) -> Result<F, EmuError> {
    assert_eq!(size_of::<F>(), size_of::<*mut c_void>(), "F is a function pointer");
    let c = CString::new(name).map_err(|e| EmuError::Load(e.to_string()))?;
    // SAFETY: handle is a live library; dlsym only looks the name up.
    let f = unsafe { libc::dlsym(handle, c.as_ptr()) };
    if f.is_null() {
        return Err(EmuError::Load(format!("{} has no kernel `{name}`", path.display())));
    }
    // SAFETY: F is a function pointer type (checked above); the caller promises its signature.
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&f) })
}

fn dl_error() -> String {
    // SAFETY: dlerror returns a NUL-terminated message or null.
    let e = unsafe { libc::dlerror() };
    if e.is_null() { "unknown error".into() } else { unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned() }
}

/// Hashes the headers (`.h`, `.cuh`) under `dir`, in name order.
fn hash_headers(dir: &Path, h: &mut DefaultHasher) -> Result<(), EmuError> {
    let io = |source| EmuError::Io { what: "listing", path: dir.to_path_buf(), source };
    let mut entries: Vec<PathBuf> =
        std::fs::read_dir(dir).map_err(io)?.filter_map(|e| e.ok().map(|e| e.path())).collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            hash_headers(&path, h)?;
        } else if path.extension().is_some_and(|e| e == "h" || e == "cuh") {
            (&path, read(&path)?).hash(h);
        }
    }
    Ok(())
}

fn compile(compiler: &str, build: &Build, emu: &Path, runtime: &Path, out: &Path, hash: u64) -> Result<(), EmuError> {
    let command = |cmd: &mut Command| {
        cmd.args(FLAGS).arg("-I").arg(emu.join("include")).arg("-I").arg(emu);
        for dir in &build.includes {
            cmd.arg("-I").arg(dir);
        }
        cmd.arg("-include").arg(emu.join("ava_emu.h")).arg("-x").arg("c++");
    };
    let run = |cmd: &mut Command, what: &str| -> Result<Vec<u8>, EmuError> {
        let output = cmd.output().map_err(|source| EmuError::NoCompiler { compiler: compiler.to_string(), source })?;
        if !output.status.success() {
            return Err(EmuError::Compile {
                sources: what.to_string(),
                stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
            });
        }
        Ok(output.stdout)
    };
    // Each file in a unit of its own (its statics apart from the others'), with the callers
    // of its kernels after it.
    let pid = std::process::id();
    let mut units = Vec::new();
    for (i, source) in build.sources.iter().enumerate() {
        let source =
            source.canonicalize().map_err(|e| EmuError::Io { what: "finding", path: source.clone(), source: e })?;
        let mut pre = Command::new(compiler);
        command(&mut pre);
        let text = run(pre.arg("-E").arg(&source), &source.display().to_string())?;
        let kernels = kernels_in(&String::from_utf8_lossy(&text), &source);
        let mut unit = format!("#include \"{}\"\n#include \"ava_emu_call.h\"\n", source.display());
        for k in &kernels {
            unit.push_str(&format!("AVA_EMU_KERNEL({k})\n"));
        }
        let path = build.out_dir.join(format!("ava-emu-unit-{hash:016x}-{pid}-{i}.cpp"));
        std::fs::write(&path, unit).map_err(|e| EmuError::Io { what: "writing", path: path.clone(), source: e })?;
        units.push(path);
    }
    // Written under a temporary name and renamed, so a concurrent test never loads half a file.
    let partial = out.with_extension(format!("so.{pid}"));
    let mut cmd = Command::new(compiler);
    command(&mut cmd);
    cmd.args(&units).arg(runtime).arg("-o").arg(&partial);
    let sources = build.sources.iter().map(|s| s.display().to_string()).collect::<Vec<_>>().join(", ");
    let result = run(&mut cmd, &sources);
    for unit in &units {
        let _ = std::fs::remove_file(unit);
    }
    result?;
    std::fs::rename(&partial, out).map_err(|source| EmuError::Io { what: "renaming", path: partial, source })
}

/// The `extern "C"` functions defined in `source` itself (not in the headers it includes),
/// read from its preprocessed text: `extern "C" void name(` once CUDA's keywords expanded to
/// nothing. The line markers (`# 12 "file"`) say which file a line came from.
fn kernels_in(preprocessed: &str, source: &Path) -> Vec<String> {
    let source = source.to_string_lossy();
    let mut in_source = false;
    let mut text = String::new();
    for line in preprocessed.lines() {
        if let Some(marker) = line.strip_prefix("# ") {
            in_source = marker.split('"').nth(1).is_some_and(|f| f == source);
            continue;
        }
        if in_source {
            text.push_str(line);
            text.push(' ');
        }
    }
    let mut names = Vec::new();
    let mut rest = text.as_str();
    while let Some(at) = rest.find("extern \"C\"") {
        rest = &rest[at + 10..];
        let words: Vec<&str> = rest.split_whitespace().take(2).collect();
        if words.first() == Some(&"void")
            && let Some(name) = words.get(1).map(|w| w.split('(').next().unwrap_or(""))
            && !name.is_empty()
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        {
            names.push(name.to_string());
        }
    }
    names
}

#[cfg(test)]
mod cache_tests {
    use std::os::unix::fs::PermissionsExt as _;

    use super::cache_dir_in;

    /// This user's directory is made private and taken; one open to others, another user's,
    /// or another user's link to a directory (a third user's, or this user's own) is refused.
    #[test]
    fn the_cache_is_this_users_own_or_refused() {
        let tmp = tempfile::tempdir().unwrap();
        // SAFETY: getuid has no preconditions.
        let uid = unsafe { libc::getuid() };
        let dir = cache_dir_in(tmp.path()).unwrap();
        assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700);
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = cache_dir_in(tmp.path()).unwrap_err().to_string();
        assert!(e.contains("is not this user's own") && e.contains("mode 777"), "{e}");
        std::fs::remove_dir(&dir).unwrap();
        if uid != 0 {
            eprintln!("not root: another user's files cannot be made here; only this user's own were checked");
            return;
        }
        let (third, own) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        std::os::unix::fs::chown(third.path(), Some(65533), Some(65533)).unwrap();
        for target in [third.path(), own.path()] {
            std::os::unix::fs::symlink(target, &dir).unwrap();
            std::os::unix::fs::lchown(&dir, Some(65534), Some(65534)).unwrap();
            let e = cache_dir_in(tmp.path()).unwrap_err().to_string();
            assert!(e.contains("is a symbolic link owned by uid 65534, another user: not followed"), "{e}");
            std::fs::remove_file(&dir).unwrap();
        }
        std::fs::create_dir(&dir).unwrap();
        std::os::unix::fs::chown(&dir, Some(65534), Some(65534)).unwrap();
        let e = cache_dir_in(tmp.path()).unwrap_err().to_string();
        assert!(e.contains("is not this user's own (owner 65534"), "{e}");
    }
}
