// llama.cpp's DRY sampler on given logits: argv model(vocab) mult base allowed last_n; stdin: breakers line
// (JSON-free: \x1f-separated), context tokens line, logits line; stdout: the penalized logits (%.9g)
#include "llama.h"
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>
int main(int argc, char ** argv) {
    llama_backend_init();
    auto mp = llama_model_default_params();
    mp.vocab_only = true;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    const llama_vocab * vocab = llama_model_get_vocab(model);
    float mult = atof(argv[2]), base = atof(argv[3]);
    int allowed = atoi(argv[4]), last_n = atoi(argv[5]);
    std::string line;
    std::getline(std::cin, line);
    std::vector<std::string> br;
    { std::string cur; for (char c : line) { if (c == '\x1f') { br.push_back(cur); cur.clear(); } else cur += c; } if (!cur.empty()) br.push_back(cur); }
    for (auto & b : br) { std::string o; for (size_t i = 0; i < b.size(); ++i) { if (b[i] == '\\' && i + 1 < b.size() && b[i+1] == 'n') { o += '\n'; ++i; } else o += b[i]; } b = o; }
    std::vector<const char *> cb; for (auto & b : br) cb.push_back(b.c_str());
    llama_sampler * s = llama_sampler_init_dry(vocab, mult, base, allowed, last_n, cb.data(), cb.size());
    std::getline(std::cin, line);
    { std::istringstream is(line); int t; while (is >> t) llama_sampler_accept(s, t); }
    std::getline(std::cin, line);
    std::vector<llama_token_data> d; { std::istringstream is(line); float v; int i = 0; while (is >> v) d.push_back({i++, v, 0.0f}); }
    llama_token_data_array arr = {d.data(), d.size(), -1, false};
    llama_sampler_apply(s, &arr);
    for (auto & x : d) printf("%.9g\n", x.logit);
    return 0;
}
