// Strict JSON for the files fp4sim reads back (configs, checkpoint metadata): one JSON value and
// nothing after it, no key twice in one object. nlohmann::json alone keeps the last of two equal
// keys and, read from a stream, stops at the end of the first value; a config with a typo'd
// duplicate or a checkpoint file with bytes appended would then load without a word.
#pragma once

#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

namespace fp4sim::model {

struct StrictJsonError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// `text` as JSON; throws StrictJsonError starting with `source` (a path, "state.json of ...") on a
// syntax error, on data after the value ("trailing data"), or on a key repeated in one object
// (naming the key's path, e.g. 'train.lr').
nlohmann::json parse_strict_json(const std::string& text, const std::string& source);

// The whole file at `path`, parsed as above; a file that cannot be read is a StrictJsonError too.
nlohmann::json read_strict_json_file(const std::string& path);

}  // namespace fp4sim::model
