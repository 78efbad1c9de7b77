//! A chain of dependent phases run by one team call: every item of phase `p` finishes before
//! any item of phase `p + 1` starts, and between the two a serial step (`after(p)`) runs once,
//! on whichever thread finished phase `p`'s last item.
//!
//! Why: a batch-1 decode step of SmolLM2 hands the team ~150 calls a token (four products and
//! the attention of each layer), and each call costs ~1 us beyond its work on 2 threads (a lock
//! to publish the call, the helper's wake-up through the epoch, a count of users to wait for;
//! `pool::tests::team_handoff_cost`). Here the helpers join once per step and then move from
//! phase to phase by watching one counter, and the norms and quantization between products run
//! on the thread that happens to finish last, with no hand-back to the caller.
//!
//! Items are claimed one at a time from a counter per phase, as `Team::run`'s chunks are, so a
//! helper that is late or has no core only leaves more items to the others: nothing ever waits
//! for a particular thread, only for items some running thread has claimed. A team that is busy
//! with another caller runs the whole chain on the calling thread.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use super::error::GemvError;
use super::pool::Team;

/// What a chain of phases does. `items` and `phases` must give the same answer every time they
/// are asked (every thread asks).
pub trait PhasePlan: Sync {
    fn phases(&self) -> usize;
    /// The items of phase `p` (0 is allowed: `after(p)` then runs alone).
    fn items(&self, p: usize) -> usize;
    /// Item `i` of phase `p`. Items of one phase run concurrently, so each must write only what
    /// no other item of the phase reads or writes.
    fn item(&self, p: usize, i: usize);
    /// Runs once between phase `p`'s items and phase `p + 1`'s (also after the last phase),
    /// alone: no item runs meanwhile.
    fn after(&self, p: usize);
}

/// A phase's claim and completion counters, on a cache line of their own (the threads take
/// turns writing them; two phases on one line would move it for nothing).
#[repr(align(64))]
#[derive(Default)]
struct Counters {
    next: AtomicUsize,
    done: AtomicUsize,
}

/// The open phase's number, alone on its cache line (every waiting thread reads it).
#[repr(align(64))]
#[derive(Default)]
struct Open(AtomicUsize);

struct Chain<'a> {
    plan: &'a dyn PhasePlan,
    counters: Vec<Counters>,
    /// Phases whose `after` has run: phase `open` is the one whose items may run now.
    open: Open,
    panicked: AtomicBool,
}

impl Chain<'_> {
    fn caught(&self, f: impl FnOnce()) {
        if catch_unwind(AssertUnwindSafe(f)).is_err() {
            self.panicked.store(true, Ordering::Relaxed);
        }
    }

    /// Closes phase `p`: its `after`, then the next phase opens (the release publishes
    /// everything `after` and the items before it wrote to the threads that see the new value).
    fn close(&self, p: usize) {
        self.caught(|| self.plan.after(p));
        self.open.0.store(p + 1, Ordering::Release);
    }

    /// One thread's share: from the open phase on, claim items until the phase has none left,
    /// wait for the next phase to open, and so on to the end.
    fn work(&self) {
        let phases = self.counters.len();
        let mut p = self.open.0.load(Ordering::Acquire);
        while p < phases {
            let (n, c) = (self.plan.items(p), &self.counters[p]);
            loop {
                let i = c.next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    if n == 0 && i == 0 {
                        self.close(p); // an empty phase: the first to look closes it
                    }
                    break;
                }
                self.caught(|| self.plan.item(p, i));
                // AcqRel: the thread that counts the last item sees every item's writes (the
                // increments form one release sequence) before its `after` reads them
                if c.done.fetch_add(1, Ordering::AcqRel) + 1 == n {
                    self.close(p);
                }
            }
            p += 1;
            let mut spins = 0u32;
            while self.open.0.load(Ordering::Acquire) < p {
                spins = spins.wrapping_add(1);
                if spins % 1024 == 0 {
                    std::thread::yield_now(); // the thread finishing the phase may need this core
                } else {
                    std::hint::spin_loop();
                }
            }
        }
    }
}

/// Runs `plan`'s phases to the end on `team` (the caller and the helpers that join). Err when
/// an item or an `after` panicked (the chain still runs to its end, so no thread is left
/// waiting; what the plan computed after the panic is not to be used).
pub fn run_phases(team: &Team, plan: &dyn PhasePlan) -> Result<(), GemvError> {
    let chain = Chain {
        plan,
        counters: (0..plan.phases()).map(|_| Counters::default()).collect(),
        open: Open::default(),
        panicked: AtomicBool::new(false),
    };
    // one entry per thread: an entry that starts after the end (a thread that took two, the
    // others having finished) returns at once
    team.run(team.threads(), &|_| chain.work())?;
    debug_assert_eq!(chain.open.0.load(Ordering::Acquire), chain.counters.len());
    if chain.panicked.load(Ordering::Relaxed) {
        return Err(GemvError::Threads { reason: "a phase of a team call panicked".to_string() });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gemv::pool;
    use std::sync::Mutex;

    /// Phase `p` adds `p` to every slot (one item a slot), and `after(p)` checks that all of them
    /// hold the sum so far and records that it ran: a phase that started before the last one
    /// ended, or an `after` that ran twice or saw a partial phase, fails.
    struct Sums {
        slots: Vec<AtomicUsize>,
        widths: Vec<usize>,
        afters: Mutex<Vec<usize>>,
        bad: AtomicBool,
        panic_at: Option<(usize, usize)>,
    }

    impl PhasePlan for Sums {
        fn phases(&self) -> usize {
            self.widths.len()
        }
        fn items(&self, p: usize) -> usize {
            self.widths[p]
        }
        fn item(&self, p: usize, i: usize) {
            assert!(self.panic_at != Some((p, i)), "item {i} of phase {p}");
            let want: usize = (0..p).filter(|&q| self.widths[q] > i).sum();
            if self.slots[i].fetch_add(p, Ordering::Relaxed) != want {
                self.bad.store(true, Ordering::Relaxed);
            }
        }
        fn after(&self, p: usize) {
            for (i, s) in self.slots.iter().enumerate() {
                let want: usize = (0..=p).filter(|&q| self.widths[q] > i).sum();
                if s.load(Ordering::Relaxed) != want {
                    self.bad.store(true, Ordering::Relaxed);
                }
            }
            self.afters.lock().unwrap().push(p);
        }
    }

    fn sums(widths: Vec<usize>, panic_at: Option<(usize, usize)>) -> Sums {
        let most = widths.iter().copied().max().unwrap_or(0);
        Sums { slots: (0..most).map(|_| AtomicUsize::new(0)).collect(), widths, afters: Mutex::new(Vec::new()),
               bad: AtomicBool::new(false), panic_at }
    }

    #[test]
    fn phases_run_in_order_each_after_once_on_teams_of_several_sizes() {
        for threads in 1..=4 {
            let team = pool::team(threads).unwrap();
            for round in 0..50usize {
                let widths: Vec<usize> = (0..1 + round % 13).map(|p| (p * 7 + round) % 11).collect(); // zeros included
                let plan = sums(widths.clone(), None);
                run_phases(&team, &plan).unwrap();
                assert!(!plan.bad.load(Ordering::Relaxed), "threads {threads} widths {widths:?}");
                assert_eq!(*plan.afters.lock().unwrap(), (0..widths.len()).collect::<Vec<_>>());
            }
        }
    }

    /// A panicking item fails its call, every phase still closes (no thread left waiting), and
    /// the team serves the next call.
    #[test]
    fn a_panicking_item_fails_the_call_and_the_chain_still_ends() {
        let team = pool::team(2).unwrap();
        let plan = sums(vec![3, 4, 2], Some((1, 2)));
        assert!(matches!(run_phases(&team, &plan), Err(GemvError::Threads { .. })));
        assert_eq!(*plan.afters.lock().unwrap(), vec![0, 1, 2]);
        let plan = sums(vec![3, 4, 2], None);
        run_phases(&team, &plan).unwrap();
        assert!(!plan.bad.load(Ordering::Relaxed));
    }

    /// Two callers racing for one team: one gets it, the other runs its chain alone; both right.
    #[test]
    fn racing_callers_each_get_their_whole_chain() {
        std::thread::scope(|scope| {
            for _ in 0..3 {
                scope.spawn(|| {
                    let team = pool::team(2).unwrap();
                    for round in 0..100usize {
                        let plan = sums((0..5).map(|p| 1 + (p + round) % 6).collect(), None);
                        run_phases(&team, &plan).unwrap();
                        assert!(!plan.bad.load(Ordering::Relaxed));
                        assert_eq!(plan.afters.lock().unwrap().len(), 5);
                    }
                });
            }
        });
    }

    /// `cargo test --release --lib phase_handoff_cost -- --ignored --nocapture`: what a phase costs
    /// beyond its work on 2 threads (chains of 150 phases, as a batch-1 SmolLM2 token has, of 0, 2, 4
    /// or 8 items of busy work, an `after` of nothing), against `pool::tests::team_handoff_cost`'s
    /// calls.
    #[test]
    #[ignore]
    fn phase_handoff_cost() {
        fn busy(ns: u64) {
            let since = std::time::Instant::now();
            while since.elapsed().as_nanos() < ns as u128 {
                std::hint::spin_loop();
            }
        }
        struct Busy(usize, u64);
        impl PhasePlan for Busy {
            fn phases(&self) -> usize {
                150
            }
            fn items(&self, _: usize) -> usize {
                self.0
            }
            fn item(&self, _: usize, _: usize) {
                busy(self.1)
            }
            fn after(&self, _: usize) {}
        }
        let team = pool::team(2).unwrap();
        for (items, ns) in [(0usize, 0u64), (2, 2000), (4, 1000), (8, 500)] {
            let n = 200;
            let since = std::time::Instant::now();
            for _ in 0..n {
                run_phases(&team, &Busy(items, ns)).unwrap();
            }
            let per = since.elapsed().as_secs_f64() / (n * 150) as f64 * 1e6;
            let ideal = (items as f64 * ns as f64 / 2.0) / 1000.0;
            println!("{items} items of {ns} ns on 2 threads: {per:.2} us a phase ({:.2} us over half the work)", per - ideal);
        }
    }
}
