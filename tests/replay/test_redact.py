"""Redaction: each detector in both directions, consistent placeholders, names from cues, config patterns,
and work that grows as the text does."""

from __future__ import annotations

import copy
import cProfile
import json
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collector import redact
from collector.redact import Finding, Redactor, detect


def found(s: str, **kw: Any) -> list[tuple[str, str]]:
    return [(f.detector, s[f.start:f.end]) for f in detect(s, **kw)]


# --- each detector, both directions -------------------------------------------------------------

@pytest.mark.parametrize("detector, value", [
    ("email", "anna.rossi+care@example.co.uk"),
    ("phone", "+44 20 7946 0958"),
    ("phone", "020 7946 0958"),            # GB, national
    ("phone", "(415) 555-2671"),           # US
    ("phone", "06 12 34 56 78"),           # FR
    ("phone", "339 123 4567"),             # IT
    ("phone", "030 12345678"),             # DE
    ("phone", "612 345 678"),              # ES
    ("phone", "0041 44 668 18 00"),
    ("phone", "41 44 668 18 00"),          # international without its "+"
    ("card", "4111 1111 1111 1111"),
    ("card", "5555-5555-5555-4444"),
    ("card", "378282246310005"),            # 15 digits, Amex
    ("iban", "GB82 WEST 1234 5698 7654 32"),
    ("iban", "DE89370400440532013000"),
    ("national_id", "123-45-6789"),         # US SSN
    ("national_id", "AB123456C"),           # UK National Insurance number
    ("national_id", "RSSMRA85T10A562S"),    # Italian codice fiscale
    ("national_id", "1 85 05 78 006 084 91"),  # French NIR, key 91
    ("national_id", "12345678Z"),           # Spanish DNI
    ("national_id", "X1234567L"),           # Spanish NIE
    ("address", "12 Baker Street"),
    ("address", "221B Baker St"),
    ("address", "via Roma 12"),
    ("address", "rue de la Paix 5"),
    ("address", "5 rue de la Paix"),
    ("address", "Hauptstraße 3"),
    ("address", "Berliner Str. 5"),
    ("address", "calle Mayor 7"),
    ("address", "Calle de Alcalá, 45"),
    ("address", "rua Augusta 10"),
])
def test_each_detector_finds_its_values(detector: str, value: str) -> None:
    assert found(f"so: {value}. ok") == [(detector, value)]


# Written the way a web page, a phone's keyboard or someone trying to slip past the redactor writes them.
@pytest.mark.parametrize("detector, value", [
    ("card", "4111\u00a01111\u00a01111\u00a01111"),     # no-break space
    ("card", "4111\u20091111\u20091111\u20091111"),     # thin space
    ("card", "4111\u202f1111\u202f1111\u202f1111"),     # narrow no-break space
    ("card", "4111/1111/1111/1111"),
    ("card", "4111_1111_1111_1111"),
    ("card", "4111.1111.1111.1111"),
    ("card", "4111  1111  1111  1111"),
    ("card", "4111 - 1111 - 1111 - 1111"),
    ("card", "4111 1111-1111.1111"),                    # grouped by four, separators mixed
    ("card", "3782 822463 10005"),                      # Amex, 4-6-5
    ("card", "4111\u20111111\u20111111\u20111111"),     # non-breaking hyphen
    ("card", "4111\u200b1111\u200b1111\u200b1111"),     # zero-width space
    ("card", "４１１１ １１１１ １１１１ １１１１"),           # full-width digits
    ("iban", "GB82-WEST-1234-5698-7654-32"),
    ("iban", "DE89.3704.0044.0532.0130.00"),
    ("iban", "GB82\u00a0WEST\u00a01234\u00a05698\u00a07654\u00a032"),
    ("national_id", "X-1234567-L"),                     # Spanish NIE
    ("national_id", "X 1234567 L"),
    ("national_id", "12345678-Z"),                      # Spanish DNI
    ("national_id", "12345678 Z"),
    ("national_id", "12.345.678-Z"),
    ("national_id", "1-85-05-78-006-084-91"),           # French NIR
    ("national_id", "1.85.05.78.006.084.91"),
    ("email", "anna\u00adrossi@example.com"),           # soft hyphen
    ("email", "anna\u200brossi@exam\u200bple.com"),     # zero-width spaces
    ("email", "anna＠example.com"),                      # full-width at sign
    ("email", "user@[192.168.0.1]"),
    ("email", "user@192.168.0.1"),
    ("email", "user@[IPv6:2001:db8::1]"),
    ("phone", "+44 7700 900123"),                       # the UK's range for drama: possible, not valid
    ("phone", "+44\u00a020\u00a07946\u00a00958"),
    ("phone", "+44\u200920\u20097946\u20090958"),
    ("phone", "020\u202f7946\u202f0958"),
    ("phone", "＋４４ ２０ ７９４６ ０９５８"),
    ("phone", "٠٢٠ ٧٩٤٦ ٠٩٥٨"),                          # Arabic-Indic digits
])
def test_values_written_with_other_separators_and_characters_are_found(detector: str, value: str) -> None:
    assert found(f"so: {value}. ok") == [(detector, value)]
    assert Redactor().text(f"so: {value}. ok") == f"so: <{redact._PREFIX[detector]}_1>. ok"


@pytest.mark.parametrize("text", [
    "order B-35 shipped",
    "at 2026-11-29T10:02:11Z",
    "on 2026-11-29 at 10:02",
    "on 29.11.2026 10:02:11",
    "version 2.10.3",
    "ticket 1234567",
    "1234 5678 9012 3456",                  # 16 digits, Luhn fails
    "4111 1111 1111 1112",
    "GB82 WEST 1234 5698 7654 33",          # IBAN checksum fails
    "1 85 05 78 006 084 36",                # NIR key wrong
    "12345678A",                            # DNI letter wrong
    "41446681800",                          # digits alone are not read as international
    "I sent it via email 3 times",
    "I have 2 kids on the street",
    "5 minutes in a row",
    "I live on Baker Street",               # no house number: not caught (documented)
    "pain level 7 of 10, since 2 hours",
    "on 29/11/2026 10:02",
    "on 2026.11.29",
    "on 2026\u201311\u201329 at 10:02",   # en dashes
    "on 10.02.2026 10.02",
    "version 1.2.3.4",
    "from 192.168.0.1",
    "expires 12/28",
    "4111.1111.1111.1112",                  # Luhn fails, whatever the separator
    "12345678 z",                           # after a space, only a capital is a DNI's letter
    "UTC+01:00",
    "+1 2",
])
def test_look_alikes_are_not_personal_data(text: str) -> None:
    assert found(text) == []


def test_a_date_is_not_an_id() -> None:
    assert found("born 2026-11-29, id pending") == []


def test_a_luhn_invalid_card_number_is_not_a_card() -> None:
    assert "card" not in {d for d, _ in found("card 4111 1111 1111 1121")}


# --- placeholders --------------------------------------------------------------------------------

def test_the_same_value_gets_the_same_placeholder_and_different_values_the_next_number() -> None:
    r = Redactor()
    assert r.text("write a@example.com or b@example.com") == "write <EMAIL_1> or <EMAIL_2>"
    assert r.text("again A@example.com") == "again <EMAIL_1>"
    # One number, written two ways, is one phone.
    assert r.text("+44 20 7946 0958 / 020 7946 0958") == "<PHONE_1> / <PHONE_1>"
    assert r.text("card 4111-1111-1111-1111, iban GB82WEST12345698765432") == "card <CARD_1>, iban <IBAN_1>"
    assert r.text("SSN 123-45-6789 at 12 Baker Street") == "SSN <ID_1> at <ADDRESS_1>"
    assert r.counts() == {"email": 2, "phone": 1, "card": 1, "iban": 1, "national_id": 1, "address": 1}


def test_a_value_written_in_other_characters_gets_the_same_placeholder() -> None:
    r = Redactor()
    cards = "4111 1111 1111 1111, ４１１１ １１１１ １１１１ １１１１ or 4111.1111.1111.1111"
    assert r.text(cards) == "<CARD_1>, <CARD_1> or <CARD_1>"
    assert r.text("anna\u00adrossi@example.com, annarossi@example.com, anna.rossi@example.com") == \
        "<EMAIL_1>, <EMAIL_1>, <EMAIL_2>"
    # The placeholder covers the invisible characters inside the value; those around it stay.
    assert r.text("\u200bcall +44\u200b20 7946 0958\u200b") == "\u200bcall <PHONE_1>\u200b"
    r.learn(["my name is Ａｎｎａ Rossi"])
    assert r.text("An\u200bna, ANNA and Ａｎｎａ") == "<PERSON_1>, <PERSON_1> and <PERSON_1>"


def test_two_redactors_number_on_their_own() -> None:
    first, second = Redactor(), Redactor()
    first.text("a@example.com")
    assert second.text("b@example.com") == "<EMAIL_1>"


def test_placeholders_are_never_redacted_again_nor_found() -> None:
    r = Redactor(names=["Person"])
    s = "<PERSON_1> called <PHONE_2> about <ORDER_3>"
    assert r.findings(s) == [] and detect(s) == []
    assert r.text(s) == s
    once = r.text("my name is Anna, mail anna@example.com")
    assert r.text(once) == once


# --- names ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("message, name", [
    ("Hi, my name is Anna Rossi and my chest hurts", "Anna Rossi"),
    ("my name is anna rossi.", "anna rossi"),
    ("I'm Paolo, my son has a fever", "Paolo"),
    ("I am Giulia Bianchi", "Giulia Bianchi"),
    ("this is Marco speaking", "Marco"),
    ("you can call me Bea", "Bea"),
    ("bonjour, je m'appelle Marie", "Marie"),
    ("je suis Claire, j'ai mal", "Claire"),
    ("Mi chiamo Giovanni De Luca", "Giovanni De Luca"),
    ("sono Luca e ho mal di testa", "Luca"),
    ("hola, me llamo Ana de la Cruz", "Ana de la Cruz"),
    ("soy Pedro", "Pedro"),
    ("Ich heiße Hans-Peter Müller.", "Hans-Peter Müller"),
    ("ich bin Jürgen", "Jürgen"),
    ("meu nome é João", "João"),
    ("اسمي أحمد", "أحمد"),
    ("Hi Anna, how can I help?", "Anna"),
    ("Thanks, Anna!", "Anna"),
    ("I am very sorry, Tom. Order B-7781 is stuck at the depot", "Tom"),
    ("Okay, Maria, I will check.", "Maria"),
    ("Dear Mr Rossi, your appointment", "Rossi"),
    ("Best regards,\nSarah Connor", "Sarah Connor"),
    ('{"first_name": "Anna", "plan": "gold"}', "Anna"),
])
def test_names_introduced_by_a_cue_are_found(message: str, name: str) -> None:
    assert ("person", name) in found(message)


@pytest.mark.parametrize("message", [
    "I'm sorry, I'm not sure",
    "I am having chest pain",
    "I'm Sorry. I am Having chest pain",
    "I'm Looking for the pharmacy, I'm Calling about my dad",
    "I'm Italian and I'm New here",
    "I AM HAVING CHEST PAIN",
    "Good Morning, This Is Reception Speaking",   # every word capitalised: the capitals tell nothing
    "Hi, How are you? Thanks Again.",
    "Dear Customer, Hello Team, hi there",
    "Sorry, I did not get that. Sure, I can help. Of course, Sir.",
    "my name is spelled wrong on the invoice",
    "call me back tomorrow, Call me Maybe",
    "je suis malade, sono stanco, soy alérgico, ich bin Arzt",
])
def test_phrases_that_look_like_cues_name_nobody(message: str) -> None:
    assert found(message) == []


def test_a_learned_name_is_replaced_everywhere_with_its_parts() -> None:
    messages = ["ok so is it serious, ANNA wants to know", "hi, my name is Anna Rossi", "thanks anna. Ms Rossi, bye"]
    r = Redactor()
    r.learn(messages)
    assert [r.text(m) for m in messages] == [
        "ok so is it serious, <PERSON_1> wants to know", "hi, my name is <PERSON_1>",
        "thanks <PERSON_1>. Ms <PERSON_1>, bye"]
    assert r.counts() == {"person": 1}
    assert r.text("Annabel and Rossini are other people") == "Annabel and Rossini are other people"


def test_names_are_found_whole_word_and_the_longest_at_a_word() -> None:
    r = Redactor(names=["Anna Rossi", "Anna Maria Bianchi", "Johann Strauss", "Mary O'Brien", "Hans-Peter Müller"])
    assert r.text("Anna Maria Bianchi, Anna  Maria, anna rossi, Anna, Annabel, Strauß, O'Brien, Hans-Peter, Hans") == \
        "<PERSON_1>, <PERSON_2>  <PERSON_1>, <PERSON_2>, <PERSON_2>, Annabel, <PERSON_3>, <PERSON_4>, <PERSON_5>, Hans"


def test_names_in_several_languages_are_learned_and_numbered_in_order() -> None:
    r = Redactor()
    r.learn(["je m'appelle Marie", "Mi chiamo Luca", "Danke, Jürgen!"])
    assert r.text("Marie, Luca et Jürgen") == "<PERSON_1>, <PERSON_2> et <PERSON_3>"


def test_names_given_are_replaced_and_an_id_splits_on_dots() -> None:
    r = Redactor(names=["Anna Rossi", "m.bianchi", "4242", "x@example.com"])
    assert r.text("anna, Rossi, m.bianchi, Bianchi, 4242 apples") == \
        "<PERSON_1>, <PERSON_1>, <PERSON_2>, <PERSON_2>, 4242 apples"


def test_a_cue_name_in_the_text_is_found_without_learning_it() -> None:
    r = Redactor()
    assert [f.detector for f in r.findings("I'm Paolo. Paolo again")] == ["person", "person"]
    assert r.findings("Paolo") == []  # findings() learned nothing


# --- config patterns -----------------------------------------------------------------------------

def test_config_patterns_get_their_name_as_placeholder_and_come_first() -> None:
    r = Redactor({"order": r"\bB-\d+\b", "patient_ref": r"PT-\d{6}"})
    assert r.text("order B-35 for PT-123456, B-35 again") == "order <ORDER_1> for <PATIENT_REF_1>, <ORDER_1> again"
    assert r.counts() == {"order": 1, "patient_ref": 1}
    assert detect("order B-35", {"order": r"B-\d+"}) == [Finding("order", 6, 10)]


@pytest.mark.parametrize("patterns, message", [
    ({"order": "B-(\\d+"}, "redaction pattern 'order': not a valid regular expression"),
    ({"anything": "x*"}, "redaction pattern 'anything': matches the empty string"),
    ({"email": "x+"}, "redaction pattern 'email': a name is"),
    ({"my-id": "x+"}, "redaction pattern 'my-id': a name is"),
])
def test_a_bad_config_pattern_is_a_clear_error(patterns: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Redactor(patterns)


def test_a_deadline_that_has_passed_stops_redaction() -> None:
    r = Redactor()
    with pytest.raises(TimeoutError, match="redaction ran past its deadline"):
        r.text("mail anna@example.com", deadline=time.monotonic() - 1)
    with pytest.raises(TimeoutError, match="redaction ran past its deadline"):
        r.value({"to": ["anna@example.com"]}, deadline=time.monotonic() - 1)
    assert r.value({"to": ["anna@example.com"]}, deadline=time.monotonic() + 60) == {"to": ["<EMAIL_1>"]}


def test_a_config_pattern_that_backtracks_forever_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redact, "PATTERN_TIMEOUT", 0.05)
    with pytest.raises(TimeoutError, match="redaction pattern 'slow' ran longer than 0.05s"):
        Redactor({"slow": r"(a|aa)+$"}).text("a" * 60 + "b")


# --- values and records --------------------------------------------------------------------------

def test_value_redacts_strings_inside_keeps_keys_and_other_types() -> None:
    r = Redactor()
    v = {"anna@example.com": ["write anna@example.com", 3, None, True, {"phone": "+44 20 7946 0958"}], "n": 1.5}
    assert r.value(v) == {"anna@example.com": ["write <EMAIL_1>", 3, None, True, {"phone": "<PHONE_1>"}], "n": 1.5}


RECORD: dict[str, Any] = {
    "schema": "conversation/v1", "id": "c-anna.rossi@example.com", "source": "production",
    "service": "clinic-desk", "ended_by": "idle", "started_at": "2026-11-29T10:02:11Z",
    "system": "You are the clinic's assistant. Escalate emergencies.",
    "trace_ids": ["4bf92f3577b34da6a3ce929d0e0e4736"],
    "attributes": {"user.name": "Anna Rossi", "enduser.id": "u_8812", "plan": "gold"},
    "messages": [
        {"role": "user", "content": "hi my chest hurts, call me on +44 20 7946 0958",
         "at": "2026-11-29T10:02:11Z", "span_id": "00f067aa0ba902b7"},
        {"role": "assistant", "content": "", "span_id": "00f067aa0ba902b8",
         "tool_calls": [{"id": "call_1", "name": "lookup_patient", "arguments": {"phone": "+44 20 7946 0958"}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "lookup_patient",
         "content": '{"first_name": "Anna", "email": "anna.rossi@example.com"}'},
        {"role": "assistant", "content": "Thanks, Anna. I found you, Ms Rossi."},
    ],
}


def test_record_redacts_contents_arguments_system_and_attributes_and_leaves_ids() -> None:
    before = copy.deepcopy(RECORD)
    out = Redactor().record(RECORD)
    assert RECORD == before  # a new record; the input is untouched
    assert [m["content"] for m in out["messages"]] == [
        "hi my chest hurts, call me on <PHONE_1>", "",
        '{"first_name": "<PERSON_1>", "email": "<EMAIL_1>"}', "Thanks, <PERSON_1>. I found you, Ms <PERSON_1>."]
    assert out["messages"][1]["tool_calls"] == [{"id": "call_1", "name": "lookup_patient",
                                                  "arguments": {"phone": "<PHONE_1>"}}]
    assert out["attributes"] == {"user.name": "<PERSON_1>", "enduser.id": "<PERSON_2>", "plan": "gold"}
    assert out["system"] == RECORD["system"]
    for key in ("schema", "id", "source", "service", "ended_by", "started_at", "trace_ids"):
        assert out[key] == RECORD[key]
    for m, original in zip(out["messages"], RECORD["messages"]):
        assert {k: v for k, v in m.items() if k not in ("content", "tool_calls")} == \
            {k: v for k, v in original.items() if k not in ("content", "tool_calls")}


TRANSCRIPT = [
    "Hello, I'm Tom Baker and I need to change my booking",
    "Sure, Tom. What is your email and phone number?",
    "tom.baker@example.org, +44 20 7946 0958",
    "Thanks! To pay, give me the card or the IBAN",
    "card 4111 1111 1111 1111, or GB82 WEST 1234 5698 7654 32. Tom Baker, 12 Baker Street",
    "Done, Mr Baker. Anything else?",
]


def test_a_planted_transcript_is_found_before_and_clean_after() -> None:
    r = Redactor()
    assert {f.detector for m in TRANSCRIPT for f in r.findings(m)} >= {
        "person", "email", "phone", "card", "iban", "address"}
    r.learn(TRANSCRIPT)
    clean = [r.text(m) for m in TRANSCRIPT]
    assert all(r.findings(m) == [] and detect(m) == [] for m in clean)
    joined = "\n".join(clean)
    for secret in ("Tom", "Baker", "tom.baker", "7946", "4111", "WEST", "12 "):
        assert secret not in joined
    assert clean[4] == "card <CARD_1>, or <IBAN_1>. <PERSON_1>, <ADDRESS_1>"


# --- property: whatever is planted, text() leaves nothing findings() sees ------------------------

PLANTED = [
    "anna.rossi@example.com", "+44 20 7946 0958", "020 7946 0958", "(415) 555-2671", "06 12 34 56 78",
    "4111 1111 1111 1111", "5555-5555-5555-4444", "GB82 WEST 1234 5698 7654 32", "DE89370400440532013000",
    "123-45-6789", "AB123456C", "RSSMRA85T10A562S", "12345678Z", "1 85 05 78 006 084 91", "12 Baker Street",
    "via Roma 12", "5 rue de la Paix", "Hauptstraße 3", "calle Mayor 7", "my name is Anna Rossi",
    "mi chiamo Luca", "Hi Marco,", "Dear Mrs Dupont",
    "4111.1111.1111.1111", "４１１１ １１１１ １１１１ １１１１", "4111\u200b1111\u200b1111\u200b1111",
    "GB82-WEST-1234-5698-7654-32", "X-1234567-L", "1-85-05-78-006-084-91", "anna\u00adrossi@example.com",
    "user@[192.168.0.1]", "+44 7700 900123", "+44\u200920\u20097946\u20090958",
]
FILLER = ["ok", "order B-35", "2026-11-29", "version 2.10.3", "the pain", "Luca", "Rossi", "12", "+", "-", "at"]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(PLANTED), st.sampled_from(FILLER),
                          st.text(alphabet="0123456789 -+.,()aB\n", max_size=10)), max_size=12),
       st.sampled_from([", ", "\n", " and ", "; "]))
def test_nothing_is_found_in_what_text_returns(parts: list[str], sep: str) -> None:
    s = sep.join(parts)
    r = Redactor()
    out = r.text(s)
    assert r.findings(out) == []
    for value in PLANTED:
        if value in parts and not value[0].isalpha():  # the ones that are values in themselves
            assert value not in out


def test_json_arguments_are_learned_from_as_a_record_sends_them() -> None:
    r = Redactor()
    r.learn([json.dumps({"full_name": "Ada Lovelace"})])
    assert r.text("Ada called, Lovelace") == "<PERSON_1> called, <PERSON_1>"


# --- property: the work grows as the text does -------------------------------------------------------

def calls(work: Callable[[], object]) -> int:
    """The Python function calls ``work`` makes: a count of its work that no other process on the machine
    changes, as the time it takes would be."""
    profile = cProfile.Profile()
    profile.enable()
    try:
        work()
    finally:
        profile.disable()
    return sum(entry.callcount for entry in profile.getstats())


SEPARATE = "\n|\n"  # a line no detector reads across: it joins no value to the next


@pytest.mark.slow
@settings(max_examples=20, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(PLANTED), st.sampled_from(FILLER),
                          st.text(alphabet="0123456789 -+.,()@aB\n", max_size=10)), min_size=1, max_size=6))
def test_copies_of_a_text_are_redacted_as_copies_for_as_much_work_each(parts: list[str]) -> None:
    chunk = " ".join(parts)
    once = Redactor().text(chunk)  # phonenumbers also reads a region's metadata the first time it needs it
    out: dict[int, str] = {}
    work = {n: calls(lambda n=n: out.setdefault(n, Redactor().text(SEPARATE.join([chunk] * n)))) for n in (16, 64)}
    assert out[64] == SEPARATE.join([once] * 64)
    # Each value found was once checked against every value accepted before it: the square of their number.
    # A little over 4: the copies at either end have fewer neighbours to look at.
    assert work[64] <= 4.2 * work[16]


@pytest.mark.parametrize("chunk", [
    "a@b.co ", "4111 1111 1111 1111 ", "+44 20 7946 0958, ", "my name is Anna Rossi. ", "12 Baker Street ",
    "GB82 WEST 1234 5698 7654 32 ", "29.11.2026 10:02 ", "1 ", "1.", "(", "1" + " " * 20, "I'm Anna. ", "Hi Anna, ",
    "\u200b4",
])
def test_the_work_grows_as_a_text_of_one_shape_does(chunk: str) -> None:
    Redactor().text(chunk * 2)
    small, large = (calls(lambda n=n: Redactor().text(chunk * n)) for n in (64, 256))
    assert large <= 4.2 * small
