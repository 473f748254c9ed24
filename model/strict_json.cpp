#include "model/strict_json.hpp"

#include <fstream>
#include <set>
#include <sstream>
#include <vector>

namespace fp4sim::model {

using Json = nlohmann::json;

namespace {

struct DuplicateKey {
  std::string path;
};

}  // namespace

Json parse_strict_json(const std::string& text, const std::string& source) {
  // the objects open at this point of the parse: the keys seen in each, and its current key
  struct OpenObject {
    std::set<std::string> keys;
    std::string key;
  };
  std::vector<OpenObject> open;
  bool complete = false;  // the top-level value has ended: any error now is trailing data
  const Json::parser_callback_t check = [&](int depth, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
        open.emplace_back();
        break;
      case Json::parse_event_t::key: {
        const std::string key = parsed.get<std::string>();
        if (!open.back().keys.insert(key).second) {
          std::string path;
          for (size_t i = 0; i + 1 < open.size(); ++i) path += open[i].key + ".";
          throw DuplicateKey{path + key};
        }
        open.back().key = key;
        break;
      }
      case Json::parse_event_t::object_end:
        open.pop_back();
        break;
      default:
        break;
    }
    if (depth == 0 &&
        (event == Json::parse_event_t::object_end || event == Json::parse_event_t::array_end ||
         event == Json::parse_event_t::value))
      complete = true;
    return true;
  };
  try {
    return Json::parse(text, check);
  } catch (const DuplicateKey& d) {
    throw StrictJsonError(source + ": duplicate key '" + d.path + "'");
  } catch (const Json::parse_error& e) {
    if (complete)
      throw StrictJsonError(source + ": trailing data after the JSON value (at byte " +
                            std::to_string(e.byte) + " of " + std::to_string(text.size()) + ")");
    throw StrictJsonError(source + ": not valid JSON (" + e.what() + ")");
  }
}

Json read_strict_json_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw StrictJsonError(path + ": cannot open");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw StrictJsonError(path + ": read failed");
  return parse_strict_json(text.str(), path);
}

}  // namespace fp4sim::model
