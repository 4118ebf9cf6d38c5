# Writes the headers that `cmake --install` puts under <prefix>/include/cudp/, run at build time as
#   cmake -DSOURCE_DIR=<repo> -DOUTPUT_DIR=<dir> -DHEADER_LIST=<file> -P cudpPublicHeaders.cmake
#
# Why: inside the repository the sources include each other from the repository root
# ("layers/module.h"), which only resolves when the root is on the include path. Exporting that
# root (<prefix>/include/cudp) to users would put generic names such as data/loader.h on every
# consumer's include path. So the installed copies say <cudp/layers/module.h> instead, and the
# package exports <prefix>/include alone. The sources stay as they are.
#
# HEADER_LIST names one header a line, relative to SOURCE_DIR. include/cudp/x.h is installed as
# cudp/x.h, every other header as cudp/<its path>. A quoted include is looked up as the compiler
# would (beside the including file, then from the root and from include/); one that names no header
# in the list stops the build, because the installed copy could not compile.
cmake_minimum_required(VERSION 3.25)

foreach(var SOURCE_DIR OUTPUT_DIR HEADER_LIST)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "cudpPublicHeaders.cmake: -D${var}=... is required")
  endif()
endforeach()

file(STRINGS "${HEADER_LIST}" headers)

# Installed name (under cudp/) of every header, keyed by the name the sources use for it.
function(cudp_installed_name source_rel out)
  if(source_rel MATCHES "^include/cudp/(.*)$")
    set(${out} "${CMAKE_MATCH_1}" PARENT_SCOPE)
  else()
    set(${out} "${source_rel}" PARENT_SCOPE)
  endif()
endfunction()

set(known "")
foreach(rel IN LISTS headers)
  cudp_installed_name("${rel}" name)
  list(APPEND known "${name}")
endforeach()

foreach(rel IN LISTS headers)
  cudp_installed_name("${rel}" name)
  get_filename_component(name_dir "${name}" DIRECTORY)
  file(READ "${SOURCE_DIR}/${rel}" text)

  # "(^|\n)[ \t]*#[ \t]*include[ \t]*\"path\"": directives only, not quotes in comments.
  string(REGEX MATCHALL "(^|\n)[ \t]*#[ \t]*include[ \t]*\"[^\"\n]+\"" directives "${text}")
  foreach(directive IN LISTS directives)
    string(REGEX MATCH "\"([^\"]+)\"" _ "${directive}")
    set(target "${CMAKE_MATCH_1}")
    set(resolved "")
    if(name_dir AND "${name_dir}/${target}" IN_LIST known)
      set(resolved "${name_dir}/${target}")
    elseif(target IN_LIST known)
      set(resolved "${target}")
    endif()
    if(resolved STREQUAL "")
      message(FATAL_ERROR
        "cudp: the installed header cudp/${name} (from ${rel}) includes \"${target}\", which is "
        "not a header cudp installs. Include a public cudp header, or a system header with <...>.")
    endif()
    string(REGEX REPLACE "\"[^\"]+\"" "<cudp/${resolved}>" replacement "${directive}")
    string(REPLACE "${directive}" "${replacement}" text "${text}")
  endforeach()

  # Unchanged files keep their time stamps, so an install copies only what changed.
  set(out "${OUTPUT_DIR}/cudp/${name}")
  set(old "")
  if(EXISTS "${out}")
    file(READ "${out}" old)
  endif()
  if(NOT old STREQUAL text)
    file(WRITE "${out}" "${text}")
  endif()
endforeach()
