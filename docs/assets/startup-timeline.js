// The interactive start-up timeline (docs/startup-timeline.md).
//
// It computes the plan that `asyncengine plugins timeline` prints, from the same rules: the JSON that
// `asyncengine plugins timeline --export-rules FILE` writes (startup-timeline-rules.json, next to this
// script). The Python side applies them in asyncengine/cli/reports/timeline.py; this file applies them
// the same way, step by step, so the two cannot say different things without a test noticing
// (tests/docs/test_startup_timeline_page.py compares the page with the CLI for several settings).
(function () {
  "use strict";

  // Where the rules lie: beside this script, wherever the site is served from.
  var RULES_URL = new URL("startup-timeline-rules.json", document.currentScript.src).href;

  // --- the rules, applied ------------------------------------------------------------------------

  // Python's str.format for the rules' templates: a placeholder without a value is a mistake in the rules.
  function fill(template, values) {
    return template.replace(/\{(\w+)\}/g, function (_, key) {
      if (!(key in values)) {
        throw new Error("the rules' template " + JSON.stringify(template) + " needs {" + key + "}");
      }
      return String(values[key]);
    });
  }

  function PageError(message) {
    this.message = message;
  }

  // The allow-list as the option gives it: split at commas, names trimmed, empty names dropped.
  function parseAllowList(text) {
    var names = new Set();
    text.split(",").forEach(function (name) {
      if (name.trim()) names.add(name.trim());
    });
    return names;
  }

  // Python's default string order (by code point) for plain names.
  function byCodePoint(a, b) {
    return a < b ? -1 : a > b ? 1 : 0;
  }

  // setting: {inProcess, tp, device, allowList (null: unset, else the option's text), installed: [{name, group}]}
  function computePlan(rules, setting) {
    var groups = {};
    rules.groups.forEach(function (group, index) {
      groups[group.key] = Object.assign({ index: index }, group);
    });
    // installed_plugins(): one per (group, name), by group in the rules' order, then by name.
    var seenKeys = new Set();
    var installed = [];
    setting.installed.forEach(function (plugin) {
      var key = plugin.group + "\u0000" + plugin.name;
      if (!seenKeys.has(key)) {
        seenKeys.add(key);
        installed.push(plugin);
      }
    });
    installed.sort(function (a, b) {
      return groups[a.group].index - groups[b.group].index || byCodePoint(a.name, b.name);
    });

    // The allow-list: unknown names are an error listing what is installed.
    var allow = rules.allow_list;
    var names = setting.allowList === null ? null : parseAllowList(setting.allowList);
    var source = names === null ? "unset" : allow.option;
    if (names !== null) {
      var known = new Set(installed.map(function (p) { return p.name; }));
      var unknown = Array.from(names).filter(function (n) { return !known.has(n); }).sort(byCodePoint);
      if (unknown.length) {
        var listing = installed.map(function (p) {
          return fill(allow.installed_plugin, { name: p.name, entry_point_group: groups[p.group].entry_point_group });
        }).join(", ") || allow.no_plugin_installed;
        throw new PageError(fill(allow.unknown_names_error,
          { source: source, unknown: unknown.join(", "), installed: listing }));
      }
    }
    function verdict(plugin) {
      if (names === null) {
        return groups[plugin.group].opt_in ? fill(allow.opt_in_reason, { group: plugin.group }) : null;
      }
      return names.has(plugin.name) ? null : fill(allow.not_named_reason, { source: source });
    }

    var backend = setting.tp === 1 ? rules.default_backend.one_rank : rules.default_backend.several_ranks;
    var facts = { in_process: setting.inProcess, multiprocess: !setting.inProcess, uni: backend === "uni",
                  mp: backend === "mp", several_ranks: setting.tp > 1 };
    var values = { tp: setting.tp, device: setting.device };
    function holds(conditions) {
      return conditions.every(function (c) {
        if (!(c in facts)) throw new Error("the rules name an unknown condition " + c);
        return facts[c];
      });
    }
    function kept(templates, key, more) {
      return templates.filter(function (t) { return typeof t === "string" || holds(t.when); })
        .map(function (t) { return fill(typeof t === "string" ? t : t[key || "text"], Object.assign({}, values, more)); });
    }

    var plans = [];
    rules.processes.forEach(function (process) {
      if (!holds(process.when)) return;
      var ranks = process.per_rank ? Array.from({ length: setting.tp }, function (_, i) { return i; }) : [null];
      ranks.forEach(function (rank) {
        var plays = kept(process.plays, "role");
        var plan = { role: fill(process.role, { rank: rank }), where: kept(process.where)[0], plays: plays, phases: [] };
        if (holds(process.plugin_phases.when)) {
          plan.phases = pluginPhases(rules, groups, new Set(plays), setting, installed, verdict,
                                     process.plugin_phases.chooses_platform);
        }
        process.phases.forEach(function (phase) {
          plan.phases.push({ name: phase.name, details: kept(phase.details), subjects: [],
                             platform_hooks: kept(phase.platform_hooks) });
        });
        plans.push(plan);
      });
    });
    return plans;
  }

  function pluginPhases(rules, groups, roles, setting, installed, verdict, choosesPlatform) {
    var texts = rules.texts;
    function playsAny(roleList) {
      return roleList.some(function (r) { return roles.has(r); });
    }
    function seen(keys) {
      return installed.filter(function (p) { return keys.indexOf(p.group) >= 0 && playsAny(groups[p.group].roles); });
    }
    function names(key) {
      return seen([key]).map(function (p) {
        var why = verdict(p);
        return why === null ? p.name : fill(texts.skipped, { plugin: p.name, reason: why });
      });
    }
    function subjects(keys) {
      return seen(keys).map(function (p) { return p.name; });
    }
    var join = function (list) { return list.join(texts.list_separator); };
    var platform, hooks = [];
    if (choosesPlatform) {
      platform = setting.device !== "auto" ? [fill(texts.device_chosen, { device: setting.device })]
        : names(rules.platform_group).map(function (n) { return fill(texts.detector, { plugin: n }); })
          .concat([texts.builtin_detectors]);
      platform.push(texts.chooses_platform_hook);
      hooks = texts.chooses_platform_hooks.slice();
    } else {
      platform = [texts.platform_from_frontend];
    }
    var roleGroups = rules.role_group_order.filter(function (key) { return playsAny(groups[key].roles); })
      .map(function (key) { return fill(texts.role_group, { group: key, plugins: join(names(key)) || texts.none_installed }); });
    var general = names(rules.general_group);
    var phaseNames = rules.plugin_phases;
    // The page sets no module:attr option (scheduler_cls, ...): `plugins timeline --scheduler-cls` shows those.
    var phases = [
      { name: phaseNames[0], details: platform, subjects: subjects([rules.platform_group]), platform_hooks: hooks },
      { name: phaseNames[1], details: general.length ? general : [texts.none_installed],
        subjects: subjects([rules.general_group]), platform_hooks: [] },
      { name: phaseNames[2], details: roleGroups.length ? roleGroups : [texts.no_role_group],
        subjects: subjects(rules.role_group_order), platform_hooks: [] },
      { name: phaseNames[3], details: [texts.no_config_hook], subjects: [], platform_hooks: [] },
    ];
    if (!choosesPlatform) {
      var registries = Object.keys(rules.registries).filter(function (name) { return playsAny(rules.registries[name]); });
      phases.push({ name: phaseNames[4],
                    details: [fill(texts.registries, { registries: join(registries) || texts.no_registries })],
                    subjects: registries.map(function (name) { return fill(texts.registry_subject, { registry: name }); }),
                    platform_hooks: [] });
    }
    return phases;
  }

  // What `asyncengine plugins timeline` prints (format_plan in timeline.py).
  function formatPlan(plans) {
    var lines = [];
    plans.forEach(function (plan) {
      lines.push(plan.role + " (" + plan.where + ")");
      plan.phases.forEach(function (phase, index) {
        lines.push("  " + (index + 1) + ". " + phase.name);
        phase.details.forEach(function (detail) { lines.push("       " + detail); });
      });
    });
    return lines.join("\n");
  }

  // --- the form ----------------------------------------------------------------------------------

  function shellQuote(text) {
    return /^[A-Za-z0-9_.,:=\/-]+$/.test(text) ? text : "'" + text.replace(/'/g, "'\\''") + "'";
  }

  function groupKey(rules, name) {
    var match = rules.groups.filter(function (g) { return g.key === name || g.entry_point_group === name; });
    return match.length ? match[0].key : null;
  }

  // The settings the form describes, or a PageError saying what to fix.
  function readForm(root, rules) {
    var tpText = root.querySelector("#ae-tp").value.trim();
    if (!/^[1-9][0-9]*$/.test(tpText)) {
      throw new PageError("tensor-parallel size: a whole number from 1, got " + JSON.stringify(tpText));
    }
    var device = root.querySelector("#ae-device").value.trim();
    if (!device) throw new PageError("device: auto, cpu, cuda or a platform plugin's name");
    var installed = [];
    root.querySelectorAll("input.ae-sample:checked").forEach(function (box) {
      box.dataset.plugins.trim().split(/\s+/).forEach(function (item) {
        var parts = item.split("=");
        installed.push({ name: parts[0], group: parts[1] });
      });
    });
    root.querySelector("#ae-typed").value.split("\n").forEach(function (line, index) {
      var words = line.trim().split(/\s+/).filter(Boolean);
      if (!words.length) return;
      var key = words.length === 2 ? groupKey(rules, words[1]) : null;
      if (key === null) {
        throw new PageError("other installed plugins, line " + (index + 1) + " (" + JSON.stringify(line.trim()) +
          "): write NAME GROUP, GROUP one of " + rules.groups.map(function (g) { return g.key; }).join(", "));
      }
      installed.push({ name: words[0], group: key });
    });
    var allowSet = root.querySelector("#ae-allow-set").checked;
    return { inProcess: root.querySelector("#ae-mode-in-process").checked, tp: parseInt(tpText, 10),
             device: device, allowList: allowSet ? root.querySelector("#ae-allow").value : null,
             installed: installed };
  }

  function commandLine(setting) {
    var words = ["asyncengine", "plugins", "timeline"];
    if (setting.inProcess) words.push("--in-process");
    if (setting.tp !== 1) words.push("--tp", String(setting.tp));
    if (setting.device !== "auto") words.push("--device", shellQuote(setting.device));
    if (setting.allowList !== null) words.push("--plugins", shellQuote(setting.allowList));
    return words.join(" ");
  }

  function element(tag, className, text) {
    var node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function renderPlan(container, plans) {
    container.textContent = "";
    plans.forEach(function (plan) {
      var section = element("section", "ae-process");
      section.dataset.role = plan.role;
      var heading = element("h3", "ae-process-heading");
      heading.appendChild(element("span", "ae-role", plan.role));
      heading.appendChild(document.createTextNode(" ("));
      heading.appendChild(element("span", "ae-where", plan.where));
      heading.appendChild(document.createTextNode(")"));
      section.appendChild(heading);
      section.appendChild(element("p", "ae-plays", "plays the roles: " + plan.plays.join(", ")));
      var list = element("ol", "ae-phases");
      plan.phases.forEach(function (phase) {
        var item = element("li", "ae-phase");
        item.appendChild(element("strong", "ae-phase-name", phase.name));
        var details = element("ul", "ae-details");
        phase.details.forEach(function (detail) {
          details.appendChild(element("li", "ae-detail" + (/\(skipped: /.test(detail) ? " ae-skipped" : ""), detail));
        });
        item.appendChild(details);
        if (phase.platform_hooks.length) {
          var hooks = element("p", "ae-hooks", "Platform hooks: ");
          phase.platform_hooks.forEach(function (hook, index) {
            if (index) hooks.appendChild(document.createTextNode(", "));
            hooks.appendChild(element("code", "ae-hook", hook));
          });
          item.appendChild(hooks);
        }
        if (phase.subjects.length) {
          var records = element("p", "ae-records", "records in the start-up trace: ");
          phase.subjects.forEach(function (subject, index) {
            if (index) records.appendChild(document.createTextNode(", "));
            records.appendChild(element("code", "ae-subject", subject));
          });
          item.appendChild(records);
        }
        list.appendChild(item);
      });
      section.appendChild(list);
      container.appendChild(section);
    });
  }

  function update(root, rules) {
    var error = root.querySelector("#ae-error");
    var plan = root.querySelector("#ae-plan");
    var text = root.querySelector("#ae-text");
    var command = root.querySelector("#ae-command");
    root.querySelector("#ae-allow").disabled = !root.querySelector("#ae-allow-set").checked;
    var setting;
    try {
      setting = readForm(root, rules);
      command.textContent = commandLine(setting);
      var plans = computePlan(rules, setting);
      renderPlan(plan, plans);
      text.textContent = formatPlan(plans);
      error.textContent = "";
      error.hidden = true;
    } catch (problem) {
      if (!(problem instanceof PageError)) throw problem;
      plan.textContent = "";
      text.textContent = "";
      if (!setting) command.textContent = "";
      // An allow-list naming what is not installed is the CLI's configuration error (exit status 2).
      error.textContent = setting ? fill(rules.allow_list.cli_error, { message: problem.message }) : problem.message;
      error.hidden = false;
    }
    root.dataset.state = "rendered";
  }

  function start() {
    var root = document.getElementById("ae-timeline");
    if (!root) return;
    fetch(RULES_URL).then(function (response) {
      if (!response.ok) throw new Error(RULES_URL + ": HTTP " + response.status);
      return response.json();
    }).then(function (rules) {
      var redraw = function () { update(root, rules); };
      root.addEventListener("input", redraw);
      root.addEventListener("change", redraw);
      redraw();
    }).catch(function (problem) {
      var error = root.querySelector("#ae-error");
      error.textContent = "The page could not read its rules (" + problem.message + "). Serve the site " +
        "(mkdocs serve) rather than opening the file, or run asyncengine plugins timeline.";
      error.hidden = false;
      root.dataset.state = "failed";
    });
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
