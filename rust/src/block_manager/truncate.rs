//! Truncate: a sequence drops its trailing tokens (speculative decoding's rollback of
//! rejected draft tokens).
//!
//! ```text
//!  block_size 4; d = draft token (PLACEHOLDER_TOKEN), its K/V written by the verify step
//!  before    | t0 t1 t2 t3 | t4 t5 d d | d _ _ _ |
//!  truncate(seq, 7)      (one draft accepted: t6 = the first d, given by set_token)
//!  after     | t0 t1 t2 t3 | t4 t5 t6 _ |            the last page held only dropped tokens: released;
//!                                                    slot 7 of the kept page is rewritten later
//! ```
//!
//! Draft tokens are appended as [`PLACEHOLDER_TOKEN`](super::PLACEHOLDER_TOKEN), the same
//! id asynchronous scheduling uses for a token not sampled yet, so `commit` never hashes a
//! block that holds one: no unverified token reaches the prefix cache, and so none is ever
//! demoted to the host or disk tier (only cached pages are). The accepted ones are given
//! afterwards with [`set_token`](BlockManager::set_token), which hashes the blocks they
//! complete; the rejected ones are cut here.
//!
//! Why a truncation can never corrupt a page someone else reads:
//! - a dropped page is released once (this table's reference); a page shared with a fork
//!   or pinned by a step keeps its other users and its content;
//! - a kept, partly filled last page that is shared is copied on write by the next
//!   `append_tokens` (its length is no longer a block multiple), as any shared tail is; so
//!   is one that the prefix cache holds by then (another user of the page filled and
//!   committed it after the cut, then left: found by the property test);
//! - a page this sequence hashed (in the prefix cache, or waiting for its step to
//!   publish it), or that the device cache holds under any hash, is never cut into:
//!   `truncate` refuses, because the next append would rewrite cached content in place.
//!
//! All or nothing: every check comes before the first change.

use super::BlockManager;
use crate::error::{invalid, CoreError, SeqId};

impl BlockManager {
    /// Drops the tokens of `seq` past its first `num_tokens`; returns how many pages left its
    /// table. Pages holding only dropped tokens go back to the pool (or to their other users);
    /// the committed count is capped at `num_tokens`. Refused, with nothing changed, when
    /// `num_tokens` is 0 or above the sequence's length, when the sequence is swapped out,
    /// when it would cut into a page released out of the sliding window, or into a page the
    /// prefix cache holds (see the module docs).
    pub fn truncate(&mut self, seq: SeqId, num_tokens: usize) -> Result<usize, CoreError> {
        let s = self.seq_on_device(seq, "truncate")?;
        let bs = self.cfg.block_size;
        let len = s.tokens.len();
        if num_tokens == 0 || num_tokens > len {
            return Err(invalid!(
                "truncate of sequence {seq}: num_tokens = {num_tokens} must be in 1..={len} (its length); free it to drop every token"
            ));
        }
        if num_tokens < s.hashes.len() * bs {
            return Err(invalid!(
                "truncate of sequence {seq} to {num_tokens} tokens would cut into its first {} tokens, whose pages are in the \
                 prefix cache (committed and verified); the shortest allowed is {}",
                s.hashes.len() * bs,
                s.hashes.len() * bs
            ));
        }
        if num_tokens < s.released * bs {
            return Err(invalid!(
                "truncate of sequence {seq} to {num_tokens} tokens would cut into pages released out of the sliding window \
                 (its first {} tokens)",
                s.released * bs
            ));
        }
        let keep = num_tokens.div_ceil(bs);
        if num_tokens % bs != 0 {
            let last = s.table[keep - 1];
            if self.gpu.cache.hash_of(last).is_some() {
                return Err(invalid!(
                    "truncate of sequence {seq} to {num_tokens} tokens would cut into device block {last}, which the prefix \
                     cache holds; a later append would rewrite cached content"
                ));
            }
        }
        let mut s = self.seqs.remove(&seq).expect("checked above");
        let dropped = s.table.len() - keep;
        for &b in s.table[keep..].iter().rev() {
            self.gpu.release(b, 1); // on the device (checked), and never a window placeholder (keep >= released)
        }
        self.gpu.flush();
        s.table.truncate(keep);
        s.on_host.truncate(keep);
        s.tokens.truncate(num_tokens);
        s.committed = s.committed.min(num_tokens);
        self.seqs.insert(seq, s);
        Ok(dropped)
    }
}
