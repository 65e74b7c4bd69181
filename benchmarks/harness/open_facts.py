"""Open questions the 135M model can answer: capitals and chemical symbols.

The library's built-in open domains hold 56 capitals and 50 elements; this module adds the other
countries and elements with the same question templates, so that the open-ended benchmark
(``open_calibration.py``) can train and test on a domain where the model is not hopeless (a greedy
5-shot probe of SmolLM2-135M-Instruct answered about three quarters of the built-in capitals and
elements exactly). Several accepted spellings are listed where a capital has more than one
(official seat and seat of government, accents).
"""

from __future__ import annotations

from llm_calib.data import builtin_open_questions
from llm_calib.data.records import OpenQA

__all__ = ["fact_questions"]

MORE_CAPITALS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Luxembourg", ("Luxembourg",)), ("Iceland", ("Reykjavik", "Reykjavík")), ("Estonia", ("Tallinn",)),
    ("Latvia", ("Riga",)), ("Lithuania", ("Vilnius",)), ("Belarus", ("Minsk",)),
    ("Moldova", ("Chisinau", "Chișinău")), ("Slovakia", ("Bratislava",)), ("Slovenia", ("Ljubljana",)),
    ("Croatia", ("Zagreb",)), ("Serbia", ("Belgrade",)), ("Bosnia and Herzegovina", ("Sarajevo",)),
    ("Montenegro", ("Podgorica",)), ("Albania", ("Tirana",)), ("North Macedonia", ("Skopje",)),
    ("Bulgaria", ("Sofia",)), ("Malta", ("Valletta",)), ("Cyprus", ("Nicosia",)), ("Monaco", ("Monaco",)),
    ("Andorra", ("Andorra la Vella",)), ("Liechtenstein", ("Vaduz",)), ("San Marino", ("San Marino",)),
    ("Russia", ("Moscow",)), ("the United Kingdom", ("London",)), ("Georgia", ("Tbilisi",)),
    ("Armenia", ("Yerevan",)), ("Azerbaijan", ("Baku",)),
    ("Afghanistan", ("Kabul",)), ("Bangladesh", ("Dhaka",)), ("Bhutan", ("Thimphu",)),
    ("Cambodia", ("Phnom Penh",)), ("Laos", ("Vientiane",)), ("Mongolia", ("Ulaanbaatar", "Ulan Bator")),
    ("North Korea", ("Pyongyang",)), ("Singapore", ("Singapore",)), ("Taiwan", ("Taipei",)),
    ("Iraq", ("Baghdad",)), ("Syria", ("Damascus",)), ("Jordan", ("Amman",)), ("Lebanon", ("Beirut",)),
    ("Kuwait", ("Kuwait City",)), ("Qatar", ("Doha",)), ("Bahrain", ("Manama",)), ("Oman", ("Muscat",)),
    ("Yemen", ("Sanaa", "Sana'a")), ("the United Arab Emirates", ("Abu Dhabi",)), ("Kazakhstan", ("Astana",)),
    ("Uzbekistan", ("Tashkent",)), ("Turkmenistan", ("Ashgabat",)), ("Kyrgyzstan", ("Bishkek",)),
    ("Tajikistan", ("Dushanbe",)), ("Sri Lanka", ("Sri Jayawardenepura Kotte", "Colombo")),
    ("Myanmar", ("Naypyidaw", "Nay Pyi Taw")), ("the Maldives", ("Malé", "Male")),
    ("Brunei", ("Bandar Seri Begawan",)), ("East Timor", ("Dili",)), ("Israel", ("Jerusalem",)),
    ("South Africa", ("Pretoria", "Cape Town", "Bloemfontein")), ("Tanzania", ("Dodoma",)),
    ("Zimbabwe", ("Harare",)), ("Zambia", ("Lusaka",)), ("Angola", ("Luanda",)), ("Mozambique", ("Maputo",)),
    ("Namibia", ("Windhoek",)), ("Botswana", ("Gaborone",)), ("Madagascar", ("Antananarivo",)),
    ("Mali", ("Bamako",)), ("Niger", ("Niamey",)), ("Chad", ("N'Djamena", "Ndjamena")), ("Sudan", ("Khartoum",)),
    ("South Sudan", ("Juba",)), ("Somalia", ("Mogadishu",)), ("Rwanda", ("Kigali",)),
    ("Burundi", ("Gitega", "Bujumbura")), ("Cameroon", ("Yaoundé", "Yaounde")), ("Gabon", ("Libreville",)),
    ("the Republic of the Congo", ("Brazzaville",)), ("the Democratic Republic of the Congo", ("Kinshasa",)),
    ("the Central African Republic", ("Bangui",)), ("Tunisia", ("Tunis",)), ("Libya", ("Tripoli",)),
    ("Mauritania", ("Nouakchott",)), ("Guinea", ("Conakry",)), ("Sierra Leone", ("Freetown",)),
    ("Liberia", ("Monrovia",)), ("Togo", ("Lomé", "Lome")), ("Burkina Faso", ("Ouagadougou",)),
    ("Eritrea", ("Asmara",)), ("Djibouti", ("Djibouti",)), ("Malawi", ("Lilongwe",)), ("Lesotho", ("Maseru",)),
    ("the Gambia", ("Banjul",)), ("Cape Verde", ("Praia",)), ("Mauritius", ("Port Louis",)),
    ("Seychelles", ("Victoria",)), ("Equatorial Guinea", ("Malabo",)), ("Guinea-Bissau", ("Bissau",)),
    ("Benin", ("Porto-Novo", "Porto Novo")), ("Ivory Coast", ("Yamoussoukro",)), ("Eswatini", ("Mbabane", "Lobamba")),
    ("Uruguay", ("Montevideo",)), ("Paraguay", ("Asunción", "Asuncion")), ("Bolivia", ("Sucre", "La Paz")),
    ("Ecuador", ("Quito",)), ("Guyana", ("Georgetown",)), ("Suriname", ("Paramaribo",)),
    ("Panama", ("Panama City",)), ("Costa Rica", ("San José", "San Jose")), ("Nicaragua", ("Managua",)),
    ("Honduras", ("Tegucigalpa",)), ("El Salvador", ("San Salvador",)), ("Guatemala", ("Guatemala City",)),
    ("Belize", ("Belmopan",)), ("Jamaica", ("Kingston",)), ("Haiti", ("Port-au-Prince", "Port au Prince")),
    ("the Dominican Republic", ("Santo Domingo",)), ("the Bahamas", ("Nassau",)), ("Barbados", ("Bridgetown",)),
    ("Trinidad and Tobago", ("Port of Spain",)), ("Papua New Guinea", ("Port Moresby",)), ("Samoa", ("Apia",)),
    ("Tonga", ("Nuku'alofa", "Nukualofa")), ("Vanuatu", ("Port Vila",)), ("the Solomon Islands", ("Honiara",)),
)
"""Countries the built-in ``capitals`` domain leaves out, with their accepted capital spellings."""

MORE_ELEMENTS: tuple[tuple[str, str], ...] = (
    ("scandium", "Sc"), ("vanadium", "V"), ("gallium", "Ga"), ("germanium", "Ge"), ("rubidium", "Rb"),
    ("yttrium", "Y"), ("zirconium", "Zr"), ("niobium", "Nb"), ("molybdenum", "Mo"), ("technetium", "Tc"),
    ("ruthenium", "Ru"), ("rhodium", "Rh"), ("palladium", "Pd"), ("indium", "In"), ("tellurium", "Te"),
    ("caesium", "Cs"), ("lanthanum", "La"), ("cerium", "Ce"), ("praseodymium", "Pr"), ("promethium", "Pm"),
    ("samarium", "Sm"), ("europium", "Eu"), ("gadolinium", "Gd"), ("terbium", "Tb"), ("dysprosium", "Dy"),
    ("holmium", "Ho"), ("erbium", "Er"), ("thulium", "Tm"), ("ytterbium", "Yb"), ("lutetium", "Lu"),
    ("hafnium", "Hf"), ("tantalum", "Ta"), ("rhenium", "Re"), ("osmium", "Os"), ("iridium", "Ir"),
    ("thallium", "Tl"), ("polonium", "Po"), ("astatine", "At"), ("francium", "Fr"), ("radium", "Ra"),
    ("actinium", "Ac"), ("thorium", "Th"), ("protactinium", "Pa"), ("neptunium", "Np"), ("americium", "Am"),
    ("curium", "Cm"), ("berkelium", "Bk"), ("californium", "Cf"), ("einsteinium", "Es"), ("fermium", "Fm"),
    ("mendelevium", "Md"), ("nobelium", "No"), ("lawrencium", "Lr"), ("rutherfordium", "Rf"), ("dubnium", "Db"),
    ("seaborgium", "Sg"), ("bohrium", "Bh"), ("hassium", "Hs"), ("meitnerium", "Mt"), ("darmstadtium", "Ds"),
    ("roentgenium", "Rg"), ("copernicium", "Cn"), ("nihonium", "Nh"), ("flerovium", "Fl"), ("moscovium", "Mc"),
    ("livermorium", "Lv"), ("tennessine", "Ts"), ("oganesson", "Og"),
)
"""The elements the built-in ``elements`` domain leaves out (118 in all with it)."""


def fact_questions(domain: str = "facts") -> list[OpenQA]:
    """Every capital and chemical-symbol question (the built-in ones first), all in ``domain``.

    Example:
        >>> qs = fact_questions()
        >>> len(qs) > 250, qs[0].question, len({q.id for q in qs}) == len(qs)
        (True, 'What is the capital of France?', True)
    """
    builtin = builtin_open_questions(60, ["capitals", "elements"])
    seen = {q.question for q in builtin}
    more = [OpenQA(f"What is the capital of {c}?", answers, domain, f"cap-{c}") for c, answers in MORE_CAPITALS]
    more += [OpenQA(f"What is the chemical symbol of {e}?", (s,), domain, f"el-{e}") for e, s in MORE_ELEMENTS]
    out = [OpenQA(q.question, q.answers, domain, q.id) for q in builtin]
    return out + [q for q in more if q.question not in seen]
