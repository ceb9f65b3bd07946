// Unit tests of the host tiling (plain C++17, no framework). Build and run:
//   g++ -std=c++17 -O1 -Wall -Wextra -Werror host/tiling.cpp host/tiling_test.cpp -o tiling_test && ./tiling_test [seed]
// Exit status 0 = all passed. tests/test_ascend_tiling.py does this with a fresh seed.
#include "tiling.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>

using namespace amla;

static int g_failures = 0;

#define CHECK(cond, ...)                                                                                             \
    do {                                                                                                             \
        if (!(cond)) {                                                                                               \
            ++g_failures;                                                                                            \
            std::fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                                     \
            std::fprintf(stderr, __VA_ARGS__);                                                                       \
            std::fprintf(stderr, "\n");                                                                              \
        }                                                                                                            \
    } while (0)

// Every token of every request is covered by exactly one item; every request has >= 1 item;
// ranges start on 512-token block boundaries; slots are a permutation of [0, numSlots);
// partOffsets are monotone and cover all items.
static void CheckPartition(const std::vector<int32_t> &lens, uint32_t cores, const Partition &p) {
    CHECK(p.partOffsets.size() == cores + 1, "partOffsets size %zu", p.partOffsets.size());
    CHECK(p.partOffsets.front() == 0 && p.partOffsets.back() == int32_t(p.items.size()), "offsets ends");
    for (uint32_t c = 0; c < cores; ++c) {
        CHECK(p.partOffsets[c] <= p.partOffsets[c + 1], "offsets not monotone at %u", c);
    }
    std::vector<std::vector<int>> cover(lens.size());
    for (size_t b = 0; b < lens.size(); ++b) {
        cover[b].assign(lens[b], 0);
    }
    std::vector<int> items(lens.size(), 0), slotSeen(p.numSlots, 0);
    for (const auto &it : p.items) {
        CHECK(it.req >= 0 && size_t(it.req) < lens.size(), "bad req %d", it.req);
        if (it.req < 0 || size_t(it.req) >= lens.size()) {
            continue;
        }
        items[it.req] += 1;
        CHECK(it.tokBegin % int32_t(kKvBlock) == 0, "range start %d not block aligned", it.tokBegin);
        CHECK(0 <= it.tokBegin && it.tokBegin <= it.tokEnd && it.tokEnd <= lens[it.req], "range [%d, %d) of len %d",
              it.tokBegin, it.tokEnd, lens[it.req]);
        for (int32_t t = it.tokBegin; t < it.tokEnd; ++t) {
            cover[it.req][t] += 1;
        }
        if (it.slot >= 0) {
            CHECK(uint32_t(it.slot) < p.numSlots, "slot %d >= %u", it.slot, p.numSlots);
            if (uint32_t(it.slot) < p.numSlots) {
                slotSeen[it.slot] += 1;
            }
        }
    }
    for (size_t b = 0; b < lens.size(); ++b) {
        CHECK(items[b] >= 1, "request %zu (len %d) has no item", b, lens[b]);
        CHECK(items[b] == p.numSplits[b], "numSplits[%zu]=%d but %d items", b, p.numSplits[b], items[b]);
        for (int32_t t = 0; t < lens[b]; ++t) {
            if (cover[b][t] != 1) {
                CHECK(false, "request %zu token %d covered %d times", b, t, cover[b][t]);
                break;
            }
        }
    }
    for (const auto &it : p.items) {
        CHECK((it.slot >= 0) == (p.numSplits[it.req] > 1), "slot %d for a request with %d splits", it.slot,
              p.numSplits[it.req]);
    }
    for (uint32_t s = 0; s < p.numSlots; ++s) {
        CHECK(slotSeen[s] == 1, "slot %u used %d times", s, slotSeen[s]);
    }
    // Balance: no part holds more than ceil(total / cores) cost units.
    int64_t total = 0;
    for (int32_t l : lens) {
        total += (l + kKvBlock - 1) / kKvBlock + 1;
    }
    const int64_t perPart = (total + cores - 1) / cores;
    for (uint32_t c = 0; c < cores; ++c) {
        int64_t cost = 0;
        for (int32_t i = p.partOffsets[c]; i < p.partOffsets[c + 1]; ++i) {
            const auto &it = p.items[i];
            cost += (it.tokEnd - it.tokBegin + kKvBlock - 1) / kKvBlock;
        }
        CHECK(cost <= perPart, "part %u has %lld token blocks > %lld", c, (long long)cost, (long long)perPart);
    }
}

static void TestPartitionRandom(std::mt19937 &rng) {
    for (int trial = 0; trial < 300; ++trial) {
        const uint32_t batch = 1 + rng() % 64;
        const uint32_t cores = 1 + rng() % 48;
        std::vector<int32_t> lens(batch);
        for (auto &l : lens) {
            const uint32_t kind = rng() % 4;
            l = kind == 0 ? 0 : kind == 1 ? int32_t(rng() % 600) : int32_t(rng() % 40000);
        }
        CheckPartition(lens, cores, PartitionWork(lens, cores));
    }
}

static void TestPartitionEdges() {
    CheckPartition({0}, 1, PartitionWork({0}, 1));
    CheckPartition({0, 0, 0}, 20, PartitionWork({0, 0, 0}, 20));
    CheckPartition({512}, 20, PartitionWork({512}, 20));
    CheckPartition({131072}, 24, PartitionWork({131072}, 24));
    const auto p = PartitionWork({131072}, 24);
    CHECK(p.numSplits[0] > 1, "one long request must be split over cores, got %d", p.numSplits[0]);
    const auto q = PartitionWork({100, 100}, 1);
    CHECK(q.numSlots == 0 && q.items.size() == 2, "one core: no splits");
    bool threw = false;
    try {
        PartitionWork({-1}, 4);
    } catch (const std::invalid_argument &) {
        threw = true;
    }
    CHECK(threw, "negative length must throw");
}

static void TestBuffersFit() {
    for (uint32_t qLen = 1; qLen <= 4; ++qLen) {
        for (uint32_t heads : {1u, 8u, 16u, 32u, 48u, 64u, 100u, 128u}) {
            const auto t = ComputeTiling({1000, 0, 70000}, qLen, heads, 128, 600, 20, 0.0416f, true, true);
            const auto errors = CheckFits(t.buffers);
            CHECK(errors.empty(), "s_q=%u h=%u: %s", qLen, heads, errors.empty() ? "" : errors[0].c_str());
            CHECK(t.header.rowTile % 16 == 0 && t.header.rowTile <= 128, "rowTile %u", t.header.rowTile);
            CHECK(t.header.rowTile * t.header.numRowTiles >= qLen * heads, "row tiles cover rows");
        }
    }
    const auto p = PlanBuffers(128);
    CHECK(p.Used("L1") <= 512 * 1024 && p.Used("L0A") <= 64 * 1024 && p.Used("L0B") <= 64 * 1024 &&
              p.Used("L0C") <= 128 * 1024 && p.Used("UB") <= 192 * 1024,
          "largest plan must fit: L1 %llu UB %llu", (unsigned long long)p.Used("L1"), (unsigned long long)p.Used("UB"));
    // The check can fail: 256-row tiles overflow L1 and L0.
    CHECK(!CheckFits(PlanBuffers(256)).empty(), "a 256-row tile must not fit");
    CHECK(!CheckFits(PlanBuffers(128, 128, 128, 64)).empty(), "64 vector rows per pass must not fit UB");
}

static void TestTilingArgumentsAndBlob() {
    bool threw = false;
    try {
        ComputeTiling({10}, 5, 16, 128, 1, 20, 0.1f, false, true);
    } catch (const std::invalid_argument &e) {
        threw = std::string(e.what()).find("qLen") != std::string::npos;
    }
    CHECK(threw, "s_q=5 must throw naming qLen");
    threw = false;
    try {
        ComputeTiling({1000}, 1, 16, 128, 2, 20, 0.1f, false, true);
    } catch (const std::invalid_argument &e) {
        threw = std::string(e.what()).find("maxBlocks") != std::string::npos;
    }
    CHECK(threw, "a length beyond the block table must throw");
    const auto t = ComputeTiling({5000, 17, 0}, 2, 128, 64, 100, 8, 0.07f, true, true);
    const auto blob = t.Serialize();
    CHECK(blob.size() == sizeof(AmlaTilingHeader) + t.partition.items.size() * sizeof(AmlaWorkItem) +
                             (t.header.numCores + 1) * sizeof(int32_t),
          "blob size %zu", blob.size());
    AmlaTilingHeader h;
    std::memcpy(&h, blob.data(), sizeof(h));
    CHECK(h.numItems == t.partition.items.size() && h.rows == 256 && h.numRowTiles == 2 && h.causal == 1,
          "header round trip");
    CHECK(h.wsTotalBytes >= h.wsPerCoreBytes * h.numCores, "workspace covers every core");
}

int main(int argc, char **argv) {
    const unsigned seed = argc > 1 ? unsigned(std::strtoul(argv[1], nullptr, 10)) : 12345u;
    std::mt19937 rng(seed);
    TestPartitionRandom(rng);
    TestPartitionEdges();
    TestBuffersFit();
    TestTilingArgumentsAndBlob();
    if (g_failures) {
        std::fprintf(stderr, "%d check(s) failed (seed %u)\n", g_failures, seed);
        return 1;
    }
    std::printf("tiling tests passed (seed %u)\n", seed);
    return 0;
}
