// marconi-hooks: llama-server's prompt cache delegated to libmarconi.
//
// server-context.cpp (patched, see ../server.patch) calls these from its one
// update loop thread; nothing here is called concurrently. Every function is
// a no-op returning the stock value when --marconi was not given.
#pragma once

#include "llama.h"

#include <cstddef>
#include <cstdint>

namespace marconi_hooks {

// Removes the --marconi* options from argv (before llama.cpp parses it) and
// remembers them:
//   --marconi                    delegate the prompt cache to libmarconi
//   --marconi-mib N              MiB of saved states in the server (64)
//   --marconi-store DIR|redis://HOST:PORT
//                                a host tier (--marconi-host-mib) and a store
//                                tier: states are written through to the
//                                store, shared with every server of the same
//                                model, and found again after a restart
//   --marconi-host-mib N         MiB of the host tier (default: --marconi-mib)
//   --marconi-model-id S         the model's identity in the store (default:
//                                a digest of the GGUF file's bytes)
//   --marconi-flops F            prefill FLOP/s of this server, what a
//                                skipped token is worth against a load (1e11)
//   --marconi-negative zero-ssm|zero-conv
//                                testing only: zero the last Mamba layer's
//                                SSM (or conv) state of every restored state
// Exits with a message on a malformed value.
void parse_args(int &argc, char **argv);

bool enabled();

// The state budget in MiB (--marconi-mib, default 64).
int budget_mib();

// Creates the cache from the model file (marconi_model_spec_from_gguf), and
// the tiers and the store with --marconi-store. Returns false (and logs)
// when libmarconi refuses the model: the server then runs stock.
bool init(const char *model_path);

// A new prompt on sequence `seq`: looks the prompt up across every state
// saved from any slot (and the host tier and the store), restores the hit
// into `seq` and returns the number of prompt tokens to skip (0: the
// sequence was cleared). Always leaves at least 2 tokens to process.
// `adapters` names the LoRA adapters active for the request ("" for none):
// states of different adapters never meet.
int begin(llama_context *ctx, int seq, const llama_token *tokens, size_t n_tokens, const char *adapters);

// True when prompt filling must stop after `n_done` tokens (a planned
// checkpoint position), so that the state there can be saved.
bool is_cut(int seq, size_t n_done);

// Called before more prompt tokens of `seq` are batched: saves the state
// when the `n_done` tokens processed so far end at a planned position.
void before_fill(llama_context *ctx, int seq, size_t n_done);

// The whole prompt of `seq` was processed (nothing decoded yet): admits the
// prompt and its states, releases the lease.
void prompt_done(llama_context *ctx, int seq, size_t n_tokens);

// The slot of `seq` was released (finished, cancelled, disconnected, error):
// releases a lease still held and frees states saved but never admitted.
void abandon(int seq);

}  // namespace marconi_hooks
