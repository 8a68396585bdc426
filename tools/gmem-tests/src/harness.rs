// SPDX-License-Identifier: GPL-2.0
//! A tiny test runner: each test runs in a forked child (so a crash or a leaked mapping of
//! one test cannot hide another's result) and reports on stdout.

use std::io::Write;

pub type TestResult = Result<(), String>;

/// Longest a single test may take (the debug kernel is ~10x slower than std).
const TEST_TIMEOUT_S: u32 = 240;

pub struct Test {
    pub name: &'static str,
    pub f: fn() -> TestResult,
}

/// `ensure!(cond, "fmt", args..)`: fail the test with a message.
#[macro_export]
macro_rules! ensure {
    ($c:expr, $($m:tt)+) => {
        if !$c {
            return Err(format!("{}:{}: {}", file!(), line!(), format!($($m)+)));
        }
    };
}

/// `expect_errno!(result, errno)`: the call must fail with exactly this errno.
#[macro_export]
macro_rules! expect_errno {
    ($r:expr, $e:expr) => {
        match $r {
            Ok(v) => return Err(format!("{}:{}: expected errno {} but call succeeded ({:?})", file!(), line!(), $e, v)),
            Err(libgmem::Errno(got)) if got == $e => {}
            Err(libgmem::Errno(got)) => {
                return Err(format!("{}:{}: expected errno {} got {}", file!(), line!(), $e, got))
            }
        }
    };
}

/// `ok!(result)`: unwrap a libgmem result or fail the test with the errno.
#[macro_export]
macro_rules! ok {
    ($r:expr) => {
        match $r {
            Ok(v) => v,
            Err(e) => return Err(format!("{}:{}: {} failed: {}", file!(), line!(), stringify!($r), e)),
        }
    };
}

/// Longest line [`say`] sends as one kernel log record: the kernel refuses a `/dev/kmsg`
/// write longer than its record limit (1024 bytes in 7.3), and the line then goes to stdout.
const RECORD_MAX: usize = 900;

/// Prints one line for the judge. Where `/dev/kmsg` can be written (the test guest boots
/// with `printk.devkmsg=on`), the line goes there as one kernel log record, which the
/// serial console prints whole: a plain write to the console can get a kernel message (a
/// provoked segfault's report, say) printed into its middle, and the judge would lose it.
fn say(line: &str) {
    let _ = std::io::stdout().flush();
    let kmsg = std::fs::OpenOptions::new().write(true).open("/dev/kmsg");
    // One write is one record.
    if kmsg.and_then(|mut k| k.write(line.as_bytes())).is_ok_and(|n| n == line.len()) {
        return;
    }
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(line.as_bytes());
    let _ = out.flush();
}

/// Prints one result line.
fn report(ok: bool, name: &str, why: &str) {
    if ok {
        say(&format!("GMEM-UTEST ok {name}\n"));
    } else {
        say(&format!("GMEM-UTEST not ok {name} # {}\n", why.replace('\n', " ")));
    }
}

/// The plan as `GMEM-UTEST-PLAN name...` lines of at most [`RECORD_MAX`] bytes, so that each
/// goes out as one record (a single line of every name, ~20 KB, went to the console as a
/// plain write and came out with kernel messages printed into it). A name too long for a
/// line of its own still gets one.
fn plan_lines(names: &[&str]) -> Vec<String> {
    const HEAD: &str = "GMEM-UTEST-PLAN";
    let mut lines = Vec::new();
    let mut line = String::from(HEAD);
    for name in names {
        if line.len() > HEAD.len() && line.len() + 1 + name.len() + 1 > RECORD_MAX {
            line.push('\n');
            lines.push(std::mem::replace(&mut line, String::from(HEAD)));
        }
        line.push(' ');
        line.push_str(name);
    }
    if line.len() > HEAD.len() {
        line.push('\n');
        lines.push(line);
    }
    lines
}

/// Sets this process's OOM score adjustment (`/proc/self/oom_score_adj`).
fn oom_score_adj(v: i32) {
    let _ = std::fs::write("/proc/self/oom_score_adj", v.to_string());
}

/// Runs every test in its own child process; returns the number of failures.
///
/// The runner first announces the whole plan ([`plan_lines`]) and makes itself
/// the OOM killer's last choice, so that a test whose memory use goes wrong fails alone
/// (the judge also fails the run on any OOM kill) instead of killing the runner and
/// silencing every later result.
pub fn run(tests: &[Test]) -> usize {
    let names: Vec<&str> = tests.iter().map(|t| t.name).collect();
    for line in plan_lines(&names) {
        say(&line);
    }
    oom_score_adj(-1000);
    let mut failed = 0;
    for t in tests {
        let _ = std::io::stdout().flush();
        let mut fds = [0i32; 2];
        // SAFETY: plain pipe(2)/fork(2)/waitpid(2) use; the child only runs the test and exits.
        unsafe {
            if libc::pipe(fds.as_mut_ptr()) != 0 {
                report(false, t.name, "pipe failed");
                failed += 1;
                continue;
            }
            let pid = libc::fork();
            if pid == 0 {
                libc::close(fds[0]);
                // Tests are ordinary processes again for the OOM killer.
                oom_score_adj(0);
                // A hung test fails alone (SIGALRM) instead of hanging the whole run.
                libc::alarm(TEST_TIMEOUT_S);
                let msg = match std::panic::catch_unwind(t.f) {
                    Ok(Ok(())) => String::new(),
                    Ok(Err(m)) => m,
                    Err(_) => "panicked".to_string(),
                };
                let code = if msg.is_empty() { 0 } else { 1 };
                libc::write(fds[1], msg.as_ptr().cast(), msg.len());
                libc::_exit(code);
            }
            libc::close(fds[1]);
            let mut buf = Vec::new();
            let mut chunk = [0u8; 512];
            loop {
                let n = libc::read(fds[0], chunk.as_mut_ptr().cast(), chunk.len());
                if n <= 0 {
                    break;
                }
                buf.extend_from_slice(&chunk[..n as usize]);
            }
            libc::close(fds[0]);
            let mut status = 0;
            libc::waitpid(pid, &mut status, 0);
            let why = String::from_utf8_lossy(&buf).to_string();
            let passed = libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0 && why.is_empty();
            if !passed {
                failed += 1;
                let why = if why.is_empty() {
                    if libc::WIFSIGNALED(status) {
                        format!("killed by signal {}", libc::WTERMSIG(status))
                    } else {
                        format!("exit status {}", libc::WEXITSTATUS(status))
                    }
                } else {
                    why
                };
                report(false, t.name, &why);
            } else {
                report(true, t.name, "");
            }
        }
    }
    failed
}

/// Runs `f` in a child process; returns the signal that killed it, or None if it exited.
pub fn child_signal(f: impl FnOnce()) -> Option<i32> {
    // SAFETY: fork/waitpid; the child only runs `f` and exits.
    unsafe {
        let pid = libc::fork();
        if pid == 0 {
            f();
            libc::_exit(0);
        }
        let mut status = 0;
        libc::waitpid(pid, &mut status, 0);
        libc::WIFSIGNALED(status).then(|| libc::WTERMSIG(status))
    }
}

/// Runs `f` in a child process and returns its exit code (f's return value).
pub fn child_exit(f: impl FnOnce() -> i32) -> i32 {
    // SAFETY: fork/waitpid; the child only runs `f` and exits.
    unsafe {
        let pid = libc::fork();
        if pid == 0 {
            let c = f();
            libc::_exit(c);
        }
        let mut status = 0;
        libc::waitpid(pid, &mut status, 0);
        if libc::WIFEXITED(status) {
            libc::WEXITSTATUS(status)
        } else {
            128 + libc::WTERMSIG(status)
        }
    }
}

/// The region's memory as u32 words.
pub fn words(r: &libgmem::Region<'_>) -> &'static mut [u32] {
    // SAFETY: the region is mapped read/write for its whole length while it lives; tests
    // drop the slice before the region.
    unsafe { std::slice::from_raw_parts_mut(r.as_ptr().cast::<u32>(), r.len / 4) }
}

pub fn open() -> Result<(libgmem::Gmem, libgmem::sim::Sim), String> {
    let g = libgmem::Gmem::open().map_err(|e| format!("open /dev/gmem: {e}"))?;
    let s = libgmem::sim::Sim::open(0).map_err(|e| format!("open /dev/gmem_sim0: {e}"))?;
    Ok((g, s))
}

/// Every page of `states` has location `loc` (and device `dev` for LOC_DEVICE).
pub fn all_at(states: &[u32], loc: u32, dev: u32) -> Result<(), String> {
    for (i, &w) in states.iter().enumerate() {
        if libgmem::q_loc(w) != loc || (loc == libgmem::GMEM_LOC_DEVICE && libgmem::q_dev(w) != dev) {
            return Err(format!("page {i}: state {w:#x}, expected loc {loc} dev {dev}"));
        }
    }
    Ok(())
}

/// Runs a shell command in the guest (busybox); fails with the command in the message.
pub fn sh(cmd: &str) -> Result<(), String> {
    let st = std::process::Command::new("/bin/sh").arg("-c").arg(cmd).status().map_err(|e| e.to_string())?;
    if st.success() {
        Ok(())
    } else {
        Err(format!("`{cmd}` failed: {st}"))
    }
}

/// Installs `handler` (an `extern "C" fn` cast to usize; three-argument `SA_SIGINFO` form if
/// `siginfo`) for `sig`. The caller guarantees the handler is async-signal-safe.
pub fn on_signal(sig: i32, handler: usize, siginfo: bool) {
    // SAFETY: a zeroed sigaction with a handler address and flags is a valid argument.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = handler;
        sa.sa_flags = if siginfo { libc::SA_SIGINFO } else { 0 };
        libc::sigaction(sig, &sa, std::ptr::null_mut());
    }
}

/// One end of a two-way link between a test and its forked child (two pipes: the guest
/// kernel has no sockets). Each side keeps its own end and drops the other after fork.
pub struct Link {
    rd: std::fs::File,
    wr: std::fs::File,
}

impl Link {
    /// Two connected ends.
    pub fn pair() -> Result<(Link, Link), String> {
        use std::os::fd::FromRawFd;
        let (mut a, mut b) = ([0i32; 2], [0i32; 2]);
        // SAFETY: pipe(2) into two local arrays; each fd is owned by exactly one File below.
        unsafe {
            if libc::pipe(a.as_mut_ptr()) != 0 || libc::pipe(b.as_mut_ptr()) != 0 {
                return Err("pipe failed".into());
            }
            let f = |fd| std::fs::File::from_raw_fd(fd);
            Ok((Link { rd: f(a[0]), wr: f(b[1]) }, Link { rd: f(b[0]), wr: f(a[1]) }))
        }
    }

    /// Tells the other side that a step is done.
    pub fn signal(&mut self) {
        let _ = std::io::Write::write_all(&mut self.wr, b"x");
    }

    /// Waits for the other side's next step; false if it went away instead.
    pub fn wait(&mut self) -> bool {
        let mut b = [0u8; 1];
        std::io::Read::read_exact(&mut self.rd, &mut b).is_ok()
    }
}

/// Forks a child that runs `setup` and then waits to be killed. Returns the child's pid
/// once `setup` has finished, and whether it succeeded.
pub fn parked_child(setup: impl FnOnce() -> bool) -> Result<(i32, bool), String> {
    let (mut me, mut peer) = Link::pair()?;
    // SAFETY: fork; the child only runs `setup`, reports, and sleeps until killed.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        drop(me);
        if setup() {
            peer.signal();
        }
        loop {
            // SAFETY: plain pause(2).
            unsafe { libc::pause() };
        }
    }
    drop(peer);
    Ok((pid, me.wait()))
}

/// SIGKILLs our child `pid` and reaps it; returns its wait status.
pub fn kill_and_reap(pid: i32) -> i32 {
    let mut status = 0;
    // SAFETY: signalling and reaping our own child.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
        libc::waitpid(pid, &mut status, 0);
    }
    status
}

/// Creates (if needed) the memory cgroup `name` under the cgroup2 root, mounting the root
/// and enabling the memory controller first; returns its directory.
pub fn memcg(name: &str) -> Result<String, String> {
    const ROOT: &str = "/sys/fs/cgroup";
    sh(&format!("grep -q ' {ROOT} ' /proc/mounts || mount -t cgroup2 none {ROOT}"))?;
    sh(&format!("echo +memory > {ROOT}/cgroup.subtree_control && mkdir -p {ROOT}/{name}"))?;
    Ok(format!("{ROOT}/{name}"))
}

/// A counter (`key=` field) of the space whose regions total `pages` pages, from
/// `/sys/kernel/debug/gmem/spaces`.
pub fn space_stat(pages: u64, key: &str) -> Result<u64, String> {
    let text = std::fs::read_to_string("/sys/kernel/debug/gmem/spaces").map_err(|e| e.to_string())?;
    let line = text
        .lines()
        .find(|l| l.contains(&format!(" pages={pages} ")))
        .ok_or(format!("no space with {pages} pages in:\n{text}"))?;
    let v = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
        .ok_or(format!("no {key} in {line}"))?;
    v.parse().map_err(|e: std::num::ParseIntError| e.to_string())
}

/// A field of this process's line in `/sys/kernel/debug/gmem/spaces` (`cpu_faults`,
/// `mirror_invalidations`, ...); an error if the process has no space or the line no
/// such field.
pub fn my_space_stat(key: &str) -> Result<u64, String> {
    let pid = std::process::id() as i32;
    let spaces = libgmem::debugfs::spaces().map_err(|e| e.to_string())?;
    let me = spaces.iter().find(|s| s.pid == pid).ok_or(format!("no space of pid {pid} in debugfs"))?;
    me.fields.get(key).copied().ok_or(format!("no {key} in this process's space line"))
}

/// A counter of the kernel's `/proc/vmstat` (`pgmigrate_success`, say).
pub fn vmstat(key: &str) -> Result<u64, String> {
    let text = std::fs::read_to_string("/proc/vmstat").map_err(|e| e.to_string())?;
    let v =
        text.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')).ok_or(format!("no {key} in /proc/vmstat"))?;
    v.trim().parse().map_err(|e: std::num::ParseIntError| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_lines_keep_every_name_in_order_within_a_record() {
        let owned: Vec<String> = (0..700).map(|i| format!("some_guest_test_number_{i}")).collect();
        let names: Vec<&str> = owned.iter().map(String::as_str).collect();
        let lines = plan_lines(&names);
        assert!(lines.len() > 1);
        let mut back = Vec::new();
        for l in &lines {
            assert!(l.len() <= RECORD_MAX, "{} bytes", l.len());
            let body = l.strip_prefix("GMEM-UTEST-PLAN ").and_then(|b| b.strip_suffix('\n'));
            back.extend(body.expect("a plan line").split(' '));
        }
        assert_eq!(back, names);
        assert!(plan_lines(&[]).is_empty());
    }
}
