/* A GGUF file's string arrays (a vocabulary: Gemma 3's holds 262,144 entries), walked in C.
 * Each string is a little-endian u64 length and then its bytes, so finding where one ends takes
 * reading the one before: a loop of a Python call per string took a quarter of a second of
 * Gemma 3's load. Here the strings are found and copied out, each followed by a zero byte, for
 * Python to decode and split in two calls (gguf_reader.py). */
#include <stdint.h>
#include <string.h>

/* The offset after `count` strings starting at `at` in `data` [size]; -1 where one runs past
 * `size`. */
int64_t gguf_strings_end(const uint8_t *data, int64_t size, int64_t at, int64_t count) {
    for (int64_t i = 0; i < count; ++i) {
        uint64_t length;
        if (size - at < 8) return -1;
        memcpy(&length, data + at, 8);
        if (length > (uint64_t)(size - at - 8)) return -1;
        at += 8 + (int64_t)length;
    }
    return at;
}

/* The `count` strings from `at` (within the file: gguf_strings_end said so) copied to `out`,
 * each followed by a zero byte: as many bytes as the strings span, less 7 for each. Returns 0,
 * or 1 where a string holds a zero byte itself (the caller then splits them by their lengths). */
int gguf_strings_join(const uint8_t *data, int64_t at, int64_t count, uint8_t *out) {
    int zero_inside = 0;
    for (int64_t i = 0; i < count; ++i) {
        uint64_t length;
        memcpy(&length, data + at, 8);
        const uint8_t *text = data + at + 8;
        zero_inside |= memchr(text, 0, length) != NULL;
        memcpy(out, text, length);
        out[length] = 0;
        out += length + 1;
        at += 8 + (int64_t)length;
    }
    return zero_inside;
}
