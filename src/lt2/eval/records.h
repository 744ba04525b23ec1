// Data records read from evaluation files, each with where it came from ("'file', line 12"), so
// every error about bad input names the file, the line (or item) and the field.
#pragma once
#include <string>
#include <vector>

#include "lt2/util/json.h"

namespace lt2::eval {

struct Record {
  json doc;           // a JSON object
  std::string where;  // "'path', line N" or "'path', item N"
};

// The lines of a text file (without their newlines); a file that does not exist is an error.
std::vector<std::string> read_lines(const std::string& path);
// One JSON object per non-empty line. Throws naming the file and line for a line that is not JSON
// or not an object, and for a file with no object.
std::vector<Record> read_jsonl(const std::string& path);
// A file holding one JSON array of objects (items numbered from 1).
std::vector<Record> read_json_array(const std::string& path);

// Fields of a record, with errors naming the record and the field: a string, an integer (a JSON
// number, or a string of digits), and a boolean (true/false, "true"/"false", 1/0).
std::string str_field(const Record& r, const char* field);
int64_t int_field(const Record& r, const char* field);
bool bool_field(const Record& r, const char* field);
// The field as a JSON value of any type; throws when it is absent.
const json& field(const Record& r, const char* name);

}  // namespace lt2::eval
