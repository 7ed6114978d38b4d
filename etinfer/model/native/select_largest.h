/* Quickselect shared by the kernels that keep each row's largest scores (block_sparse.c's
 * keep_largest, token_choice.c's choice of single tokens). */
#pragma once

#include <stdint.h>

/* The index of the k-th largest of values[0, n) once they are partially ordered around it
 * (quickselect, median of three): every value before it is >= it, every one after <= it. */
static inline int64_t select_largest(float *values, int64_t n, int64_t k) {
    int64_t low = 0, high = n - 1;
    while (low < high) {
        const int64_t middle = low + (high - low) / 2;
        float a = values[low], b = values[middle], c = values[high];
        const float pivot = a > b ? (b > c ? b : (a > c ? c : a)) : (a > c ? a : (b > c ? c : b));
        int64_t i = low, j = high;
        while (i <= j) {
            while (values[i] > pivot) ++i;
            while (values[j] < pivot) --j;
            if (i <= j) {
                const float swap = values[i];
                values[i++] = values[j];
                values[j--] = swap;
            }
        }
        if (k <= j) high = j;
        else if (k >= i) low = i;
        else return k;
    }
    return k;
}
