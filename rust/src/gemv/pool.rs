//! Persistent worker teams for the GEMV, one per thread count, built on first use and kept.
//!
//! Why not rayon (used here before): measured on an Intel Xeon (2 cores, 2026-12-02), a 576 x 576
//! Q4_1 product took 10 us on the calling thread and 35 us on a 2-thread rayon pool; even the
//! 28 MB head gained only 1.45x. `install` parks the caller and wakes each worker through a
//! futex, tens of microseconds in a VM, and a decode step makes ~120 calls. Here the caller
//! works too: it and `threads - 1` helpers claim the product's chunks one at a time, so a late
//! helper costs nothing but its help. Between calls helpers spin on an epoch counter for `SPIN`
//! (a forward calls the kernel every 10-50 us), then sleep on a condition variable until a call
//! wakes them.
//!
//! One call at a time per team: a second caller that finds the team busy (another Python thread,
//! the GIL released) runs its whole product on its own thread, which gives the same bits (output
//! tiles are independent of how they are shared out).

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::error::GemvError;

/// How long an idle helper spins before it sleeps: longer than the gaps between a forward's
/// kernel calls (norms, attention: 10-50 us), shorter than the gap between steps (sampling and
/// scheduling, milliseconds), so helpers do not hold a core the rest of the program wants.
const SPIN: Duration = Duration::from_micros(250);

/// The job a call hands its helpers, its lifetime erased: `job(i)` computes chunk `i`.
type Job = dyn Fn(usize) + Sync + 'static;

/// One call: its job and the chunks not claimed yet. Lives on the caller's stack.
struct Call {
    job: *const Job,
    total: usize,
    /// The next chunk to claim (claimed with `fetch_add`: each chunk runs exactly once).
    next: AtomicUsize,
    panicked: AtomicBool,
}

impl Call {
    /// Claims and runs chunks until none is left.
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.total {
                return;
            }
            // SAFETY: `job` outlives the call: `Team::run` returns only after its own chunks
            // and after every helper that took this call has left it (`users == 0`).
            let job = unsafe { &*self.job };
            if catch_unwind(AssertUnwindSafe(|| job(i))).is_err() {
                self.panicked.store(true, Ordering::Relaxed);
            }
        }
    }
}

/// The current call, as a pointer helpers may take while `users` counts them.
#[derive(Clone, Copy)]
struct CallPtr(*const Call);

// SAFETY: `Call` is shared by reference only (atomics and a `Sync` job), and `Team::run` keeps
// it alive until no helper uses it (see `Call::work`).
unsafe impl Send for CallPtr {}

struct Shared {
    /// Bumped (under `lock`) once per call; a helper looks for work when it sees a new value.
    epoch: AtomicU64,
    /// The call in progress; `users` counts the helpers that took it from here.
    slot: Mutex<Option<CallPtr>>,
    users: AtomicUsize,
    /// Helpers asleep on `wake` (or about to be): a call takes `lock` and notifies only then, since
    /// a notify is a futex system call even with nobody waiting (~1 us a call in a VM, 121 calls a token).
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    /// Held for the whole of a call: one call at a time.
    busy: Mutex<()>,
}

/// A caller plus `helpers` threads that wait for calls.
pub struct Team {
    shared: Arc<Shared>,
    helpers: usize,
}

impl Team {
    fn start(threads: usize) -> Result<Team, GemvError> {
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            slot: Mutex::new(None),
            users: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            busy: Mutex::new(()),
        });
        for i in 1..threads {
            let s = shared.clone();
            std::thread::Builder::new()
                .name(format!("pagedrs-gemv-{i}"))
                .spawn(move || helper(&s))
                .map_err(|e| GemvError::Threads { reason: format!("could not start {threads} threads: {e}") })?;
        }
        Ok(Team { shared, helpers: threads - 1 })
    }

    /// Threads in all (the caller and the helpers).
    pub fn threads(&self) -> usize {
        self.helpers + 1
    }

    /// Runs `job(0) .. job(total - 1)`, each exactly once, on the caller and whichever helpers
    /// join, and returns when all have run. Chunks are claimed one at a time, so a helper that
    /// has no core (another program's thread spinning on it) only leaves more chunks to the
    /// caller, never a share the caller must wait for. Err when a chunk panicked.
    pub fn run<'a>(&self, total: usize, job: &'a (dyn Fn(usize) + Sync + 'a)) -> Result<(), GemvError> {
        let s = &self.shared;
        let Ok(_busy) = s.busy.try_lock() else {
            // another call has the team: the whole product on this thread, the same bits
            if catch_unwind(AssertUnwindSafe(|| (0..total).for_each(job))).is_err() {
                return Err(GemvError::Threads { reason: "a GEMV chunk panicked".to_string() });
            }
            return Ok(());
        };
        // SAFETY: only the lifetime is erased (the same fat pointer); helpers use it only while
        // this call waits for them below, so it never outlives `job`.
        let job: *const Job = unsafe { std::mem::transmute::<&'a (dyn Fn(usize) + Sync + 'a), &'static Job>(job) };
        let call = Call { job, total, next: AtomicUsize::new(0), panicked: AtomicBool::new(false) };
        *s.slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(CallPtr(&call));
        // Dekker's handshake with a helper going to sleep (both SeqCst): the call bumps the epoch, then
        // looks for sleepers; a helper counts itself a sleeper, then looks at the epoch. One of the two
        // sees the other's write, so either the call notifies or the helper does not sleep.
        s.epoch.fetch_add(1, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) != 0 {
            let _g = s.lock.lock().unwrap_or_else(|e| e.into_inner()); // a helper between its check and its wait holds it
            s.wake.notify_all();
        }
        call.work();
        *s.slot.lock().unwrap_or_else(|e| e.into_inner()) = None;
        // helpers still inside are finishing the chunk each one claimed last
        let mut spins = 0u32;
        while s.users.load(Ordering::Acquire) != 0 {
            spins = spins.wrapping_add(1);
            if spins % 1024 == 0 {
                std::thread::yield_now(); // a helper without a core: let it have ours
            } else {
                std::hint::spin_loop();
            }
        }
        if call.panicked.load(Ordering::Relaxed) {
            return Err(GemvError::Threads { reason: "a GEMV chunk panicked".to_string() });
        }
        Ok(())
    }
}

/// A helper's life: wait for a new epoch (spinning, then sleeping), join the call if it is
/// still in progress, leave when its chunks are all claimed.
fn helper(s: &Shared) {
    let mut seen = 0u64;
    loop {
        let since = Instant::now();
        let mut spins = 0u32;
        while s.epoch.load(Ordering::Acquire) == seen {
            spins = spins.wrapping_add(1);
            if spins % 256 == 0 && since.elapsed() > SPIN {
                let mut g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
                s.sleepers.fetch_add(1, Ordering::SeqCst);
                // after counting itself (see `Team::run`): a call that bumped the epoch before this saw
                // no sleeper and will not notify, so the epoch is looked at again first
                while s.epoch.load(Ordering::SeqCst) == seen {
                    g = s.wake.wait(g).unwrap_or_else(|e| e.into_inner());
                }
                s.sleepers.fetch_sub(1, Ordering::SeqCst);
                break;
            }
            std::hint::spin_loop();
        }
        seen = s.epoch.load(Ordering::Acquire);
        let call = {
            let slot = s.slot.lock().unwrap_or_else(|e| e.into_inner());
            if slot.is_some() {
                s.users.fetch_add(1, Ordering::AcqRel); // under the slot's lock: the caller sees it
            }
            *slot
        };
        if let Some(CallPtr(ptr)) = call {
            // SAFETY: taken from the slot while the call was in progress and counted in
            // `users`, so the caller keeps `*ptr` alive until this helper leaves.
            unsafe { &*ptr }.work();
            s.users.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

static TEAMS: OnceLock<Mutex<HashMap<usize, Arc<Team>>>> = OnceLock::new();

/// The most threads a team may have: far past any CPU this runs on, low enough that a wrong
/// `cpu_threads` (say 10^6) is an error, not a million spawned threads.
pub const MAX_THREADS: usize = 1024;

/// `threads` is a team size we run: 1 to [`MAX_THREADS`].
pub fn check_threads(threads: usize) -> Result<(), GemvError> {
    if threads == 0 || threads > MAX_THREADS {
        return Err(GemvError::Threads { reason: format!("threads is {threads}; allowed: 1 to {MAX_THREADS}") });
    }
    Ok(())
}

/// The team of exactly `threads` (the caller and `threads - 1` helpers).
pub fn team(threads: usize) -> Result<Arc<Team>, GemvError> {
    check_threads(threads)?;
    let mut teams = TEAMS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    if let Some(t) = teams.get(&threads) {
        return Ok(t.clone());
    }
    let t = Arc::new(Team::start(threads)?);
    teams.insert(threads, t.clone());
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every chunk runs exactly once, on teams of several sizes, with callers racing for them.
    #[test]
    fn each_chunk_runs_once_under_racing_callers() {
        std::thread::scope(|scope| {
            for caller in 0..4usize {
                scope.spawn(move || {
                    for round in 0..200usize {
                        let total = 1 + (round * 7 + caller) % 97;
                        let hits: Vec<AtomicUsize> = (0..total).map(|_| AtomicUsize::new(0)).collect();
                        let t = team(1 + (round + caller) % 3).unwrap();
                        t.run(total, &|i| {
                            hits[i].fetch_add(1, Ordering::Relaxed);
                        })
                        .unwrap();
                        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "round {round}");
                    }
                });
            }
        });
    }

    /// A panicking chunk is an error for its call, not a dead team: the next call still runs.
    #[test]
    fn a_panicking_chunk_fails_its_call_only() {
        let t = team(2).unwrap();
        let err = t.run(64, &|i| assert!(i != 17, "chunk 17")).unwrap_err();
        assert!(matches!(err, GemvError::Threads { .. }));
        let done = AtomicUsize::new(0);
        t.run(64, &|_| {
            done.fetch_add(1, Ordering::Relaxed);
        })
        .unwrap();
        assert_eq!(done.load(Ordering::Relaxed), 64);
    }

    /// A helper that went to sleep (idle past `SPIN`) wakes for the next call: the first chunk the
    /// caller runs waits until a chunk ran on another thread (a lost wake-up fails here, after 20 s).
    /// Whichever chunk that is: on a loaded machine the woken helper may claim chunk 0 first (the
    /// test waited on chunk 0 alone before, and failed then although the helper had joined).
    #[test]
    fn a_sleeping_helper_wakes_for_the_next_call() {
        let t = Team::start(2).unwrap(); // its own team: the shared ones are busy with the other tests
        for _ in 0..3 {
            std::thread::sleep(SPIN * 8); // the helper is asleep on the condition variable by now
            let caller = std::thread::current().id();
            let others = AtomicUsize::new(0);
            let caller_chunks = AtomicUsize::new(0);
            t.run(4, &|_| {
                if std::thread::current().id() != caller {
                    others.fetch_add(1, Ordering::SeqCst);
                } else if caller_chunks.fetch_add(1, Ordering::SeqCst) == 0 {
                    let since = Instant::now();
                    while others.load(Ordering::SeqCst) == 0 {
                        assert!(since.elapsed() < Duration::from_secs(20), "the sleeping helper never joined");
                        std::thread::yield_now();
                    }
                }
            })
            .unwrap();
            assert!(others.load(Ordering::SeqCst) >= 1, "no chunk ran on the helper");
        }
    }

    /// `cargo test --release --lib team_handoff_cost -- --ignored --nocapture`: what a 2-thread call
    /// costs beyond its work: an empty call, and calls of 2 or 4 chunks of busy work (each chunk ~2 or
    /// ~1 us), back to back, against the same work on one thread.
    #[test]
    #[ignore]
    fn team_handoff_cost() {
        fn busy(ns: u64) {
            let since = Instant::now();
            while since.elapsed().as_nanos() < ns as u128 {
                std::hint::spin_loop();
            }
        }
        let t = Team::start(2).unwrap();
        for (chunks, ns) in [(0usize, 0u64), (2, 2000), (4, 1000), (8, 500)] {
            let n = 20_000;
            let since = Instant::now();
            for _ in 0..n {
                t.run(chunks, &|_| busy(ns)).unwrap();
            }
            let per = since.elapsed().as_secs_f64() / n as f64 * 1e6;
            let ideal = (chunks as f64 * ns as f64 / 2.0) / 1000.0;
            println!("{chunks} chunks of {ns} ns on 2 threads: {per:.2} us a call ({:.2} us over half the work)", per - ideal);
        }
    }

    #[test]
    fn zero_or_too_many_threads_is_refused() {
        for bad in [0, MAX_THREADS + 1, usize::MAX] {
            let err = team(bad).err().expect("refused").to_string();
            assert!(err.contains(&format!("threads is {bad}; allowed: 1 to {MAX_THREADS}")), "{err}");
        }
    }
}
