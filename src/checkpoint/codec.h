#pragma once
// The write side of the two on-disk formats behind one interface, and the one save loop that drives it.
//
// Both formats share everything but three things: how data files are named, how one piece of a tensor becomes
// bytes in a data file (libfsdp: raw row-major bytes plus xxHash blocks; DCP: one torch.save archive), and how
// the metadata is written (libfsdp: metadata.json holding the values too; DCP: the values appended as items to
// the coordinator's data file, then the .metadata pickle). A CheckpointCodec owns exactly those; save_with_codec
// owns the rest (temporary folder, per-rank report, lazily opened data files, piece loop, gather, metadata written
// last, one-rename commit). save() in both formats and convert() all run through it.

#include "checkpoint/format.h"
#include "checkpoint/planning.h"
#include "checkpoint/storage.h"

#include <fsdp/checkpoint/checkpoint.h>

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace fsdp::checkpoint::detail {

// The data files one process writes into a save's temporary folder, each opened on first use (a rank with
// nothing to write creates no file).
class DataFiles {
 public:
  DataFiles(std::string dir, FileWriter::Mode mode) : dir_(std::move(dir)), mode_(mode) {}
  FileWriter& writer(const std::string& name);
  bool empty() const { return writers_.empty(); }
  // The lowest name among the open files (the coordinator's file that DCP values are appended to).
  const std::string& first_name() const { return writers_.begin()->first; }
  // fsyncs and closes every file; returns name -> size in bytes. Idempotent.
  std::map<std::string, int64_t> close_all();

 private:
  std::string dir_;
  FileWriter::Mode mode_;
  std::map<std::string, std::unique_ptr<FileWriter>> writers_;
  std::map<std::string, int64_t> closed_;
};

class CheckpointCodec {
 public:
  virtual ~CheckpointCodec() = default;
  virtual Format format() const = 0;
  // "checkpoint::save" / "checkpoint::save (DCP)": the start of this format's save errors.
  virtual const char* save_what() const = 0;
  // The index-th data file of process `rank` (index > 0 only where a conversion keeps several files per rank).
  virtual std::string data_file_name(int rank, int index) const = 0;
  // Appends `piece` (any device, layout or grad mode; its global box `box`) to data file `file` of `files` and
  // returns its chunk record.
  virtual ChunkMeta append_piece(DataFiles& files, const std::string& file, const at::Tensor& piece,
                                 const Box& box) const = 0;
  // Whether the coordinator appends data (the values) to its data files after the gather: its files then stay
  // open until write_metadata.
  virtual bool values_in_data_files() const = 0;
  // On the coordinator, with `md` complete except `files`: writes whatever the values need into `files`,
  // closes them, records every rank's files in md.files, validates, and writes the metadata file into `tmp`
  // (`final_dir`: where the checkpoint will be, for errors and DCP's recorded checkpoint id).
  virtual void write_metadata(Metadata& md, DataFiles& files, const std::string& tmp,
                              const std::string& final_dir) = 0;
};

// block_bytes: libfsdp's checksum granularity (unused by DCP).
std::unique_ptr<CheckpointCodec> make_codec(Format format, int64_t block_bytes);

// What one process hands to the save loop. The loop calls the producer once; it declares the tensors it
// knows of (every rank may declare; declarations must agree), writes pieces into named data files and
// contributes values (JSON text; the lowest rank's wins).
class PieceSink {
 public:
  virtual ~PieceSink() = default;
  virtual void declare(const std::string& fqn, c10::ScalarType dtype, const std::vector<int64_t>& shape) = 0;
  // `shape`: the tensor's global shape (checked against its declaration); `box`: the piece's place in it.
  virtual void piece(const std::string& fqn, const at::Tensor& data, const std::vector<int64_t>& shape,
                     const Box& box, const std::string& file) = 0;
  virtual void value(const std::string& key, const std::string& json_text) = 0;
};

struct SaveJob {
  ProcessGroupPtr group;  // null: this process alone
  std::string path;       // the checkpoint folder (normalized here)
  FileWriter::Mode mode = FileWriter::Mode::Direct;
  int64_t world_size = 1;  // recorded in libfsdp's metadata
  std::string saved_on;
  int64_t block_bytes = 4 << 20;
  const char* what = nullptr;  // error prefix; default: the codec's save_what()
};

// Collective over job.group: prepares <path>.partial, runs `produce` on every rank, gathers each rank's report
// (error, declarations, chunk records, files, values), and on the coordinator builds the metadata, lets the
// codec write it and commits with one rename. Any rank's failure raises on every rank and leaves `path` as it
// was.
SaveResult save_with_codec(CheckpointCodec& codec, const SaveJob& job, const std::function<void(PieceSink&)>& produce);

}  // namespace fsdp::checkpoint::detail
