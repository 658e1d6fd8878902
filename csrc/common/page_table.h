// A paged KV cache's block table as every kernel reads it (flash_api.h): the page of column
// `column` of one sequence's row of the table. The column is kept within the row's `columns`
// entries and the page number within the cache's `num_pages` pages, so that a malformed table
// gives wrong rows but never an access outside the buffers.
#pragma once

#include <cstdint>

namespace flashattn {

__device__ inline int table_page(const int32_t* row, int column, int columns, int num_pages) {
  const int page = row[column < columns ? column : columns - 1];
  return page < 0 ? 0 : (page >= num_pages ? num_pages - 1 : page);
}

}  // namespace flashattn
