// make-gguf: writes a small random-weight hybrid GGUF that llama-server
// loads: a Nemotron-H (Mamba-2 + attention + MLP layers, the default, the
// layer layout of examples/llama-engine), a Granite 4.0 hybrid
// (granitehybrid: Mamba-2 or attention, each with a gated MLP), a Falcon-H1
// (falcon-h1: attention and Mamba-2 in every layer) or a Qwen3.5 (qwen35:
// gated delta net, gated attention every 4th layer); the tokenizer and chat
// template of a vocab-only GGUF shipped with llama.cpp's sources
// (models/ggml-vocab-*.gguf), seeded random weights (stdev 0.3, A
// negative), saved by llama_model_save_to_file.
//
// usage: make-gguf VOCAB.gguf OUT.gguf [SEED] [ARCH]

#include "ggml.h"
#include "gguf.h"
#include "llama.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

[[noreturn]] void die(const char *what) {
    std::fprintf(stderr, "make-gguf: %s\n", what);
    std::exit(2);
}

// splitmix64, as in examples/llama-engine: the same weights everywhere.
struct Rng {
    uint64_t s;
    uint64_t next() {
        uint64_t z = (s += 0x9e3779b97f4a7c15ULL);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
        return z ^ (z >> 31);
    }
    double unit() { return (double)(next() >> 11) * (1.0 / 9007199254740992.0); }
    double normal() {
        double u1 = unit(), u2 = unit();
        if (u1 < 1e-300) u1 = 1e-300;
        return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
    }
};

uint64_t fnv1a(const char *s) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (; *s; ++s) h = (h ^ (uint8_t)*s) * 0x100000001b3ULL;
    return h;
}

struct TensorInit {
    uint64_t seed;
    float stdev;
};

void set_tensor_data(ggml_tensor *t, void *ud) {
    const TensorInit &p = *(const TensorInit *)ud;
    Rng r{p.seed ^ fnv1a(t->name)};
    const bool ssm_a = std::strstr(t->name, "ssm_a") != nullptr;  // decay: A < 0
    if (t->type != GGML_TYPE_F32) die("unexpected tensor type (only f32 is generated)");
    std::vector<float> v((size_t)ggml_nelements(t));
    for (auto &x : v) {
        float f = (float)(r.normal() * p.stdev);
        x = ssm_a ? -std::fabs(f) : f;
    }
    ggml_backend_tensor_set(t, v.data(), 0, ggml_nbytes(t));
}

void quiet_log(ggml_log_level level, const char *text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
}

}  // namespace

int main(int argc, char **argv) {
    if (argc < 3 || argc > 5) die("usage: make-gguf VOCAB.gguf OUT.gguf [SEED] [ARCH]");
    const uint64_t seed = argc >= 4 ? std::strtoull(argv[3], nullptr, 10) : 12;
    const std::string arch = argc >= 5 ? argv[4] : "nemotron_h";

    gguf_init_params vp{/*no_alloc=*/true, /*ctx=*/nullptr};
    gguf_context *vocab = gguf_init_from_file(argv[1], vp);
    if (!vocab) die("cannot read the vocab GGUF");
    const int64_t tok_key = gguf_find_key(vocab, "tokenizer.ggml.tokens");
    if (tok_key < 0) die("the vocab GGUF has no tokenizer.ggml.tokens");
    const uint32_t n_vocab = (uint32_t)gguf_get_arr_n(vocab, tok_key);

    // Metadata: every key of the vocab file (tokenizer.*, chat template),
    // then the architecture keys over it.
    gguf_context *g = gguf_init_empty();
    gguf_set_kv(g, vocab);
    // M: Mamba-2, *: attention, -: MLP, H: attention and Mamba-2 side by
    // side then a gated MLP (Falcon-H1), m / a: Mamba-2 / attention, each
    // followed by a gated MLP (Granite 4.0 hybrid).
    std::string pattern;
    const uint32_t n_embd = 256, n_head = 4, n_head_kv = 2, n_ff = 512;
    if (arch == "nemotron_h") pattern = "M*-M-M*-";
    else if (arch == "granitehybrid") pattern = "mmammamm";
    else if (arch == "falcon-h1") pattern = "HHHH";
    else if (arch == "qwen35") pattern = "gggAgggA";  // g: gated delta net, A: gated attention (every 4th)
    else die("ARCH is nemotron_h, granitehybrid, falcon-h1 or qwen35");
    const uint32_t n_layer = (uint32_t)pattern.size();
    std::vector<uint32_t> kv(n_layer), ff(n_layer);
    for (uint32_t i = 0; i < n_layer; i++) {
        const char c = pattern[i];
        kv[i] = (c == '*' || c == 'a' || c == 'H' || c == 'A') ? n_head_kv : 0;
        ff[i] = c == '*' || c == 'M' ? 0 : n_ff;
    }
    const std::string a = arch + ".";
    gguf_set_val_str(g, "general.architecture", arch.c_str());
    gguf_set_val_str(g, "general.name", ("tiny-random-" + arch).c_str());
    gguf_set_val_u32(g, (a + "vocab_size").c_str(), n_vocab);
    gguf_set_val_u32(g, (a + "context_length").c_str(), 8192);
    gguf_set_val_u32(g, (a + "embedding_length").c_str(), n_embd);
    gguf_set_val_u32(g, (a + "block_count").c_str(), n_layer);
    gguf_set_arr_data(g, (a + "feed_forward_length").c_str(), GGUF_TYPE_UINT32, ff.data(), ff.size());
    gguf_set_val_u32(g, (a + "attention.head_count").c_str(), n_head);
    if (arch == "qwen35") gguf_set_val_u32(g, (a + "attention.head_count_kv").c_str(), n_head_kv);
    else gguf_set_arr_data(g, (a + "attention.head_count_kv").c_str(), GGUF_TYPE_UINT32, kv.data(), kv.size());
    gguf_set_val_f32(g, (a + "attention.layer_norm_epsilon").c_str(), 1e-5f);
    gguf_set_val_f32(g, (a + "attention.layer_norm_rms_epsilon").c_str(), 1e-5f);
    gguf_set_val_u32(g, (a + "rope.dimension_count").c_str(), n_embd / n_head);
    gguf_set_val_u32(g, (a + "ssm.conv_kernel").c_str(), 4);
    if (arch == "qwen35") {
        // Gated delta net: 2 key heads, 4 value heads of dim 64 (inner size
        // = value dim 256), full attention every 4th layer, M-RoPE.
        gguf_set_val_u32(g, (a + "ssm.inner_size").c_str(), 256);
        gguf_set_val_u32(g, (a + "ssm.state_size").c_str(), 64);
        gguf_set_val_u32(g, (a + "ssm.time_step_rank").c_str(), 4);
        gguf_set_val_u32(g, (a + "ssm.group_count").c_str(), 2);
        gguf_set_val_u32(g, (a + "full_attention_interval").c_str(), 4);
        const int32_t sections[4] = {11, 11, 10, 0};
        gguf_set_arr_data(g, (a + "rope.dimension_sections").c_str(), GGUF_TYPE_INT32, sections, 4);
        gguf_set_val_u32(g, (a + "feed_forward_length").c_str(), n_ff);
    } else {
        gguf_set_val_u32(g, (a + "ssm.inner_size").c_str(), 2 * n_embd);
        gguf_set_val_u32(g, (a + "ssm.state_size").c_str(), 64);
        gguf_set_val_u32(g, (a + "ssm.time_step_rank").c_str(), 8);
        gguf_set_val_u32(g, (a + "ssm.group_count").c_str(), 2);
    }

    llama_log_set(quiet_log, nullptr);
    llama_backend_init();
    TensorInit init{seed, 0.3f};
    llama_model *model = llama_model_init_from_user(g, set_tensor_data, &init, llama_model_default_params());
    if (!model) die("llama_model_init_from_user failed");
    llama_model_save_to_file(model, argv[2]);
    std::printf("make-gguf: wrote %s (%s %s, %u tokens of %s)\n", argv[2], arch.c_str(), pattern.c_str(), n_vocab,
                argv[1]);
    llama_model_free(model);
    gguf_free(g);
    gguf_free(vocab);
    llama_backend_free();
    return 0;
}
